"""The chat format is a library below data/, generation and serving: reading records and
rendering a conversation load no model, no training code and no torch (before, reading chat
records imported the whole model, 39 modules)."""

import json
import subprocess
import sys

READ_AND_RENDER = """
import json, sys
from gptmini.chat import BOOK, read_records, render_chat, to_messages
from gptmini.tokenizer import get_tokenizer
where, record = read_records("book")[0]
rendered = render_chat(to_messages(record, where), get_tokenizer("gpt2"), BOOK)
assert rendered.ids and any(rendered.assistant_mask)
print(json.dumps(sorted(sys.modules)))
"""


def test_reading_and_rendering_chat_records_loads_no_model_no_training_and_no_torch():
    out = subprocess.run([sys.executable, "-c", READ_AND_RENDER], capture_output=True,
                         text=True, check=True).stdout
    loaded = json.loads(out.splitlines()[-1])
    heavy = [m for m in loaded if m.split(".")[0] in ("torch", "lightning")
             or m.startswith(("gptmini.model", "gptmini.train", "gptmini.attention",
                              "gptmini.finetune", "gptmini.data"))]
    assert heavy == []
    assert "gptmini.chat.records" in loaded  # the check ran where it claims to
