"""GGUF files, llama.cpp's format (Ollama, LM Studio, the Hub's `-GGUF` repositories), read
as the Hugging Face layouts gptmini loads: the metadata becomes a config.json dict, the
tensors (dequantized to float32 by the `gguf` package) a state dict under Hugging Face's
names, the vocabulary a tiktoken encoding, the chat template and its stop token
tokenizer_config.json's fields. What llama.cpp's converter changed on the way in is undone:

    Llama's query and key rows, interleaved for its rotary kernel    put back in halves
    Gemma's RMSNorm gains, stored as 1 + weight                       less one
    Llama 3's rope scaling, baked into a `rope_freqs` tensor          read back as llama3's

Refused by name: another architecture, a tensor a layout has no place for (the experts of
an MoE file), a quantization type outside `READABLE`, a SentencePiece vocabulary (Gemma's,
Llama 2's: tiktoken holds byte-level BPE only), a split pattern (`tokenizer.ggml.pre`)
gptmini does not know.
"""

import math
import re
from pathlib import Path
from typing import NamedTuple

import numpy as np
import tiktoken
import torch
from torch import Tensor

from gptmini.tokenizer import DIGITS_PATTERN, GPT2_PATTERN, from_hf_tokenizer

__all__ = ["FAMILIES", "READABLE", "SPLITS", "GgufContents", "is_gguf", "read_gguf"]

MAGIC = b"GGUF"

LLAMA_NAMES = {  # GGUF tensor name (less `blk.{i}.` and `.weight`) -> Hugging Face's
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
GEMMA3_NAMES = {**LLAMA_NAMES, "post_attention_norm": "post_attention_layernorm",
                "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}


class Family(NamedTuple):
    """One `general.architecture` as llama.cpp writes it."""

    model_type: str
    """The Hugging Face layout it is read as (gptmini.convert.hub.LAYOUTS)."""
    names: dict[str, str]
    """Its tensors' names, GGUF's -> Hugging Face's."""
    permuted: bool
    """Query and key rows interleaved (llama.cpp's converter does it for Llama alone)."""
    norm_offset: float
    """What the converter added to every norm's gain (Gemma's 1)."""


FAMILIES = {"llama": Family("llama", LLAMA_NAMES, True, 0.0),
            "qwen3": Family("qwen3", LLAMA_NAMES, False, 0.0),
            "gemma3": Family("gemma3_text", GEMMA3_NAMES, False, 1.0)}
"""The GGUF architectures gptmini reads (SmolLM2 and Llama 3.x are `llama`)."""

CONFIG_KEYS = [  # (GGUF key after `{architecture}.`, config.json field)
    ("vocab_size", "vocab_size"), ("context_length", "max_position_embeddings"),
    ("embedding_length", "hidden_size"), ("block_count", "num_hidden_layers"),
    ("feed_forward_length", "intermediate_size"),
    ("attention.head_count", "num_attention_heads"),
    ("attention.head_count_kv", "num_key_value_heads"),
    ("attention.key_length", "head_dim"),
    ("attention.layer_norm_rms_epsilon", "rms_norm_eps"),
    ("attention.sliding_window", "sliding_window"), ("rope.freq_base", "rope_theta"),
]

READABLE = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K",
            "Q4_K", "Q5_K", "Q6_K")
"""The tensor types read (dequantized by the `gguf` package); the i-quants and the ternary
and 4-bit float ones are refused."""

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLITS = {"default": GPT2_PATTERN, "gpt2": GPT2_PATTERN, "gpt-2": GPT2_PATTERN,
          "smollm": DIGITS_PATTERN, "starcoder": DIGITS_PATTERN,
          "llama-bpe": LLAMA3_SPLIT, "llama3": LLAMA3_SPLIT, "llama-v3": LLAMA3_SPLIT,
          "smaug-bpe": LLAMA3_SPLIT, "qwen2": QWEN2_SPLIT}
"""`tokenizer.ggml.pre`, the name llama.cpp gives a vocabulary's split, -> its regex."""

CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type: special tokens, matched whole


class GgufContents(NamedTuple):
    """A GGUF file as a Hugging Face directory would hold it."""

    hf_config: dict
    """config.json's fields."""
    state: dict[str, Tensor]
    """The weights under Hugging Face's names, float32 (empty when not read)."""
    tokenizer: tiktoken.Encoding
    tokenizer_config: dict
    """tokenizer_config.json's: `chat_template`, `bos_token`, `eos_token`."""


def is_gguf(path: str | Path) -> bool:
    """Whether `path` is a file that starts as a GGUF file does (or is named `.gguf`)."""
    path = Path(path)
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == MAGIC or path.suffix == ".gguf"


def read_gguf(path: str | Path, *, weights: bool = True) -> GgufContents:
    """The config, weights (with `weights`) and tokenizer of a GGUF file.

    Raises:
        ValueError: naming the file and what gptmini cannot read in it (above).
    """
    import gguf  # a declared dependency, imported where a GGUF file is read

    path = Path(path)
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError) as err:
        raise ValueError(f"{path} is not a readable GGUF file ({type(err).__name__}: "
                         f"{str(err)[:200]}): download it again") from None
    meta = {key: field.contents() for key, field in reader.fields.items()
            if not key.startswith("GGUF.")}
    architecture = meta.get("general.architecture")
    if architecture not in FAMILIES:
        raise ValueError(f"{path} holds a {architecture!r} model, which gptmini does not read "
                         f"from GGUF: it reads {', '.join(map(repr, FAMILIES))}")
    family = FAMILIES[architecture]
    try:
        tokenizer, tokenizer_config = _tokenizer(meta, path.stem)
        hf_config = _config(meta, architecture, family, reader.tensors)
        state = _state(reader.tensors, family, hf_config) if weights else {}
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    return GgufContents(hf_config, state, tokenizer, tokenizer_config)


def _config(meta: dict, architecture: str, family: Family, tensors: list) -> dict:
    """config.json's fields from the metadata (the layout's defaults where it is silent)."""
    c = {"model_type": family.model_type,
         "tie_word_embeddings": all(t.name != "output.weight" for t in tensors)}
    for key, field in CONFIG_KEYS:
        if f"{architecture}.{key}" in meta:
            c[field] = _shortest(meta[f"{architecture}.{key}"])
    if "head_dim" not in c and f"{architecture}.rope.dimension_count" in meta:
        c["head_dim"] = meta[f"{architecture}.rope.dimension_count"]
    c.setdefault("vocab_size", len(meta.get("tokenizer.ggml.tokens", [])))
    kind = meta.get(f"{architecture}.rope.scaling.type", "none")
    if kind in ("linear", "yarn"):
        c["rope_scaling"] = {"rope_type": kind,
                             "factor": _shortest(meta[f"{architecture}.rope.scaling.factor"])}
        original = meta.get(f"{architecture}.rope.scaling.original_context_length")
        if original is not None:
            c["rope_scaling"]["original_max_position_embeddings"] = int(original)
    elif kind != "none":
        raise ValueError(f"rope scaling {kind!r} ({architecture}.rope.scaling.type), which "
                         "gptmini's layouts do not compute")
    freqs = next((t for t in tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        c["rope_scaling"] = _llama3_scaling(np.asarray(freqs.data, np.float64), c)
    return c


def _shortest(value: object) -> object:
    """A float32 number as config.json writes it (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value))) if isinstance(value, float) else value


def _llama3_scaling(factors: np.ndarray, c: dict) -> dict:
    """Llama 3's rope scaling from the per-frequency divisors llama.cpp stores for it
    (`rope_freqs`): the published settings (low 1, high 4, 8,192 positions) with the factor
    the divisors reach, checked against every divisor.

    Raises:
        ValueError: divisors no such scaling gives.
    """
    factor = float(factors.max())
    low, high, original = 1.0, 4.0, 8192
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    theta = c.get("rope_theta", 10000.0)
    expected = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * theta ** (i / head_dim)
        if wavelength < original / high:
            expected.append(1.0)
        elif wavelength > original / low:
            expected.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            expected.append(1 / ((1 - smooth) / factor + smooth))
    if factors.shape != (head_dim // 2,) or not np.allclose(factors, expected, rtol=1e-4):
        raise ValueError("its rope_freqs tensor holds frequency divisors that are not Llama "
                         "3's rope scaling (low 1, high 4, 8192 positions), which is the one "
                         "gptmini reads from it")
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
            "high_freq_factor": high, "original_max_position_embeddings": original}


def _state(tensors: list, family: Family, c: dict) -> dict[str, Tensor]:
    """The tensors, dequantized to float32, under Hugging Face's names."""
    from gguf import dequantize

    state, problems, unread = {}, [], False
    for tensor in tensors:
        match = re.fullmatch(r"(?:blk\.(\d+)\.)?(\w+)\.(weight|bias)", tensor.name)
        if tensor.name == "rope_freqs.weight":  # read as the config's rope scaling
            continue
        if match is None or match[2] not in family.names:
            problems.append(f"tensor {tensor.name!r} has no place in {family.model_type}'s "
                            "layout")
            continue
        if tensor.tensor_type.name not in READABLE:
            problems.append(f"tensor {tensor.name!r} is {tensor.tensor_type.name}")
            unread = True
            continue
        layer, part, kind = match.groups()
        name = family.names[part]
        name = name if layer is None else f"model.layers.{layer}.{name}"
        weight = np.array(dequantize(tensor.data, tensor.tensor_type), np.float32)
        if family.permuted and part in ("attn_q", "attn_k"):
            heads = (c["num_attention_heads"] if part == "attn_q"
                     else c.get("num_key_value_heads", c["num_attention_heads"]))
            weight = _halves(weight, heads)
        if family.norm_offset and part.endswith("norm"):
            weight = weight - family.norm_offset
        state[f"{name}.{kind}"] = torch.from_numpy(weight)
    if problems:
        if unread:
            problems.append(f"gptmini reads {', '.join(READABLE)}: quantize the model again "
                            "to one of them (llama-quantize ... Q4_K_M)")
        raise ValueError("; ".join(problems[:4] + problems[-1:] if len(problems) > 5
                                   else problems))
    return state


def _halves(weight: np.ndarray, heads: int) -> np.ndarray:
    """Query or key rows from llama.cpp's order (each head's rotary pairs side by side) back
    to Hugging Face's (each head's first halves, then its second halves)."""
    rows = weight.shape[0]
    return (weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _tokenizer(meta: dict, name: str) -> tuple[tiktoken.Encoding, dict]:
    """The file's vocabulary as tiktoken's, and its chat template and end tokens."""
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(
            f"its vocabulary is tokenizer.ggml.model={model!r}, not a byte-level BPE ('gpt2'): "
            "gptmini encodes text with tiktoken, which holds byte-level BPE vocabularies only "
            "(SmolLM2's, Llama 3's, Qwen's); SentencePiece ones such as Gemma's and Llama 2's "
            "have no tiktoken form. Read its weights with gptmini.convert.gguf.read_gguf")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in SPLITS:
        raise ValueError(f"its vocabulary splits text as llama.cpp's {pre!r} "
                         f"(tokenizer.ggml.pre), which gptmini does not know: it knows "
                         f"{', '.join(sorted(SPLITS))}")
    tokens = meta["tokenizer.ggml.tokens"]
    kinds = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    added = [{"content": t, "id": i} for i, (t, kind) in enumerate(zip(tokens, kinds, strict=False))
             if kind in (CONTROL, USER_DEFINED)]
    data = {"added_tokens": added, "model": {"vocab": {t: i for i, t in enumerate(tokens)}},
            "pre_tokenizer": {"type": "Split", "pattern": {"Regex": SPLITS[pre]}}}
    try:
        encoding = from_hf_tokenizer(data, name)
    except (ValueError, KeyError) as err:
        raise ValueError(f"its vocabulary is not byte-level BPE ({err})") from None
    settings = {"chat_template": meta.get("tokenizer.chat_template")}
    for key in ("bos", "eos"):
        token = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token is not None and 0 <= int(token) < len(tokens):
            settings[f"{key}_token"] = tokens[int(token)]
    return encoding, settings
