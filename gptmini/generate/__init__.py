"""Generation: sampling settings and draws (sampling.py), the book's generation loop with a
KV cache (loop.py), many prompts at once through the paged engine (engine/), batch files
(batch_file.py) and the `generate.py` command (command.py)."""

from gptmini.generate.loop import (
    GenerateOptions,
    generate,
    generate_stream,
    left_pad,
    stream_text,
)
from gptmini.generate.sampling import SamplingParams, sample

__all__ = ["GenerateOptions", "SamplingParams", "generate", "generate_stream", "left_pad",
           "sample", "stream_text"]
