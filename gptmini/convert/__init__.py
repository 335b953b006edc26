"""Hugging Face layouts in and out of `GPTModel`: GPT-2's (gpt2.py), Llama's and Qwen3's
(llama.py), DeepSeek-V3's with every layer dense (deepseek.py), Gemma 3's (gemma.py),
gpt-oss's (gptoss.py), Qwen3.5's text model (qwen3_5.py), the directories on disk (hub.py);
GGUF files read as these layouts (gguf.py).
No `transformers` import is needed."""

from gptmini.convert.deepseek import (
    config_from_deepseek,
    config_to_deepseek,
    from_deepseek_state_dict,
    to_deepseek_state_dict,
)
from gptmini.convert.gpt2 import (
    TABLE,
    config_from_hf,
    config_to_hf,
    from_hf_state_dict,
    to_hf_state_dict,
)
from gptmini.convert.hub import (
    config_of,
    directory_config,
    export_hf,
    load_hf,
    local_checkpoint,
    model_of,
    read_hf_weights,
    read_json_object,
    write_tokenizer_files,
)
from gptmini.convert.llama import (
    config_from_llama,
    config_to_llama,
    from_llama_state_dict,
    interleaved_to_halves,
    is_llama_architecture,
    to_llama_state_dict,
)
from gptmini.convert.weights import check_finite, model_from_weights

__all__ = [
    "TABLE",
    "check_finite",
    "config_from_deepseek",
    "config_from_hf",
    "config_from_llama",
    "config_of",
    "config_to_deepseek",
    "config_to_hf",
    "config_to_llama",
    "directory_config",
    "export_hf",
    "from_deepseek_state_dict",
    "from_hf_state_dict",
    "from_llama_state_dict",
    "interleaved_to_halves",
    "is_llama_architecture",
    "load_hf",
    "local_checkpoint",
    "model_of",
    "model_from_weights",
    "read_hf_weights",
    "read_json_object",
    "to_deepseek_state_dict",
    "to_hf_state_dict",
    "to_llama_state_dict",
    "write_tokenizer_files",
]
