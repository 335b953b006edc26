"""Conversion in and out of Hugging Face layouts: config.json files of other architectures
and with every field wrong (missing, a string, zero, negative, non-finite, huge), files that
are not JSON, quantized and NaN weights, read by generate.py; and exports that fail while
writing (a file-size limit, a full disk) or land in a directory of another model, whose
earlier files must be left whole."""

import json

from robustness_cases.lab import Lab, last_line, outcome

GPT2 = {"model_type": "gpt2", "vocab_size": 50257, "n_positions": 32, "n_embd": 16,
        "n_layer": 1, "n_head": 2}
LLAMA = {"model_type": "llama", "vocab_size": 257, "hidden_size": 16, "intermediate_size": 32,
         "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
         "max_position_embeddings": 32, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
               "vocab_size": 129280, "hidden_size": 7168, "num_attention_heads": 128,
               "num_hidden_layers": 61, "n_routed_experts": 256}

EXPORT = ("import sys, torch\nfrom gptmini.convert import export_hf\n"
          "from gptmini.model import GPTConfig, GPTModel\n"
          "from gptmini.tokenizer import get_tokenizer\n"
          "kind = sys.argv[2]\n"
          "llama = dict(position='rope', norm='rmsnorm', mlp='swiglu', bias=False, "
          "norm_eps=1e-6) if kind == 'llama' else dict(qkv_bias=True, tie_weights=True)\n"
          "m = GPTModel(GPTConfig(vocab_size=257, context_length=32, emb_dim=16, n_heads=2,"
          " n_layers=1, drop_rate=0.0, **llama))\n"
          "export_hf(m, sys.argv[1], get_tokenizer('byte'))\n")
"""Python exporting a tiny byte-vocabulary model (GPT-2's layout, or Llama's) to argv[1]."""


def hf_case(config, *, llama: bool = False, weights=None, tokenizer: bytes | None = None):
    """generate.py on an export whose config.json is replaced by `config` (text as it is),
    whose weights are changed by `weights` (Python on `state`), or whose tokenizer.json is
    replaced: an error is the answer, and it must name the file."""

    def case(lab: Lab):
        where = lab.folder()
        directory = where / "hf"
        lab.python(EXPORT, str(directory), "llama" if llama else "gpt2", cwd=where)
        if config is not None:
            text = config if isinstance(config, str | bytes) else json.dumps(config)
            (directory / "config.json").write_bytes(text if isinstance(text, bytes)
                                                    else text.encode())
        if weights is not None:
            code = ("import sys, torch\nfrom safetensors.torch import load_file, save_file\n"
                    "p = sys.argv[1]; state = load_file(p)\n" + weights + "\nsave_file(state, p)\n")
            lab.python(code, str(directory / "model.safetensors"), cwd=where)
        if tokenizer is not None:
            (directory / "tokenizer.json").write_bytes(tokenizer)
        proc = lab.run("generate.py", "--checkpoint", str(directory), "--max_new_tokens", "2",
                       cwd=where, timeout=120)
        result = outcome(proc)
        return ("silent" if result == "ok" else result), last_line(proc)

    return case


EXPORT_THEN_FAIL = """
import os, resource, signal, sys, torch
from pathlib import Path
from gptmini.checkpoint import load_checkpoint
from gptmini.convert import export_hf
from gptmini.model import GPTConfig, GPTModel
from gptmini.tokenizer import get_tokenizer, tokenizer_fingerprint, train_bpe

target, fault = Path(sys.argv[1]), sys.argv[2]
def model(vocab, seed):
    torch.manual_seed(seed)
    return GPTModel(GPTConfig(vocab_size=vocab, context_length=32, emb_dim=64, n_heads=2,
                              n_layers=2, drop_rate=0.0, qkv_bias=True, tie_weights=True))
first = model(257, 0)
export_hf(first, target, get_tokenizer("byte"))
before = {p.name: p.read_bytes() for p in target.iterdir()}
bpe = train_bpe(["to be or not to be, that is the question. " * 50], 280)
if fault == "fsize":  # room for a tokenizer, not for the weights
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    resource.setrlimit(resource.RLIMIT_FSIZE, (60_000, hard))
if fault == "interrupt":  # Ctrl-C with part of the weights on the disk
    import gptmini.convert.hub as hub
    def cut(state, path, metadata=None):
        Path(path).write_bytes(bytes(1000))
        raise KeyboardInterrupt
    hub.save_file = cut
try:
    if fault == "no tokenizer":
        export_hf(model(50257, 1), target)
        names = sorted(p.name for p in target.iterdir())
        print("RESULT", "silent" if "tokenizer.json" in names else "ok", names)
        sys.exit(0)
    export_hf(model(bpe.n_vocab, 1), target, bpe)
    print("RESULT silent the export claimed success under", fault)
    sys.exit(0)
except (OSError, KeyboardInterrupt) as err:
    said = str(err) or type(err).__name__
limit = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
after = {p.name: p.read_bytes() for p in target.iterdir()}
same = after == before and tokenizer_fingerprint(load_checkpoint(target).tokenizer) == \\
    tokenizer_fingerprint(get_tokenizer("byte"))
left = [p.name for p in target.parent.iterdir() if p.name.startswith(".")]
print("RESULT", "clear error" if same and not left else "data lost", said[:120], left)
"""


def export_case(fault: str):
    """An export over an earlier one, failing with `fault` (or without a tokenizer)."""

    def case(lab: Lab):
        where = lab.folder()
        proc = lab.python(EXPORT_THEN_FAIL, str(where / "export"), fault, cwd=where)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if not lines:
            return outcome(proc) if outcome(proc) == "traceback" else "harness", last_line(proc)
        _, result, detail = lines[-1].split(" ", 2)
        if result == "clear":
            result, detail = "clear error", detail.removeprefix("error ")
        return result, detail[:150]

    return case


def export_mode(lab: Lab):
    where = lab.folder()
    lab.python(EXPORT, str(where / "hf"), "gpt2", cwd=where)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in (where / "hf").iterdir()}
    return ("ok" if len(set(modes.values())) == 1 else "silent"), str(modes)


def export_into_a_folder_of_notes(lab: Lab):
    where = lab.folder()
    (where / "mine").mkdir()
    (where / "mine" / "notes.txt").write_text("do not lose me")
    proc = lab.python(EXPORT, str(where / "mine"), "gpt2", cwd=where)
    if not (where / "mine" / "notes.txt").is_file():
        return "data lost", "notes.txt is gone"
    refused = "holds files that are not a model's (notes.txt)" in proc.stderr
    return ("ok" if refused else "silent" if proc.returncode == 0 else "harness"), last_line(proc)


def without(config: dict, key: str) -> dict:
    return {k: v for k, v in config.items() if k != key}


CONFIGS = {
    "config.json: a list": hf_case([GPT2]),
    "config.json: not JSON (binary)": hf_case(b"\x89PNG\r\n\x1a\n\x00binary"),
    "config.json: empty": hf_case(""),
    "config.json: DeepSeek-V3's": hf_case(DEEPSEEK_V3),
    "config.json: only architectures, Mistral": hf_case({"architectures":
                                                         ["MistralForCausalLM"]}),
    "config.json: model_type a number": hf_case({**GPT2, "model_type": 2}),
    "GPT-2 config: no n_embd": hf_case(without(GPT2, "n_embd")),
    "GPT-2 config: n_embd a string": hf_case({**GPT2, "n_embd": "16"}),
    "GPT-2 config: n_head 0": hf_case({**GPT2, "n_head": 0}),
    "GPT-2 config: n_layer -1": hf_case({**GPT2, "n_layer": -1}),
    "GPT-2 config: n_positions 1e12": hf_case({**GPT2, "n_positions": 1e12}),
    "GPT-2 config: vocab_size null": hf_case({**GPT2, "vocab_size": None}),
    "GPT-2 config: layer_norm_epsilon NaN": hf_case({**GPT2, "layer_norm_epsilon": "NaN"}),
    "GPT-2 config: quantization_config": hf_case(
        {**GPT2, "quantization_config": {"quant_method": "bitsandbytes", "load_in_8bit": True}}),
    "Llama config: no hidden_size": hf_case(without(LLAMA, "hidden_size"), llama=True),
    "Llama config: rope_scaling a string": hf_case({**LLAMA, "rope_scaling": "linear"},
                                                   llama=True),
    "Llama config: linear scaling beside default rope_parameters": hf_case(
        {**LLAMA, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
         "rope_scaling": {"rope_type": "linear", "factor": 4.0}}, llama=True),
    "Llama config: a factor without a type": hf_case(
        {**LLAMA, "rope_scaling": {"factor": 2.0}}, llama=True),
    "Llama config: rope_theta Infinity": hf_case('{"rope_theta": Infinity, ' + json.dumps(
        without(LLAMA, "rope_theta"))[1:], llama=True),
    "Llama config: rms_norm_eps negative": hf_case({**LLAMA, "rms_norm_eps": -1e-6},
                                                   llama=True),
    "Llama config: num_key_value_heads 0": hf_case({**LLAMA, "num_key_value_heads": 0},
                                                   llama=True),
    "Llama config: fp8 quantization_config": hf_case(
        {**LLAMA, "quantization_config": {"quant_method": "fp8"}}, llama=True),
    "Llama weights: int8 without scales": hf_case(None, llama=True, weights=(
        "k = 'model.layers.0.mlp.up_proj.weight'\n"
        "state[k] = torch.randint(-127, 127, state[k].shape, dtype=torch.int8)")),
    "GPT-2 weights: NaN": hf_case(None, weights=(
        "state['transformer.ln_f.weight'][0] = float('nan')")),
    "GPT-2 weights: infinity": hf_case(None, weights=(
        "state['transformer.wte.weight'][3, :4] = float('inf')")),
    "tokenizer.json: not JSON": hf_case(None, llama=True, tokenizer=b"\x00\x01binary"),
    "tokenizer.json: a list": hf_case(None, llama=True, tokenizer=b"[1, 2, 3]"),
}

EXPORTS = {
    "export: a file-size limit hit by the weights": export_case("fsize"),
    "export: Ctrl-C while writing the weights": export_case("interrupt"),
    "export: no tokenizer over another model's": export_case("no tokenizer"),
    "export: every file readable alike (0644)": export_mode,
    "export: into a folder holding notes": export_into_a_folder_of_notes,
}

CASES = {**CONFIGS, **EXPORTS}
