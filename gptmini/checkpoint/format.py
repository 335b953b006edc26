"""The checkpoint format, written and read here only; and from a path to a model.

`load_checkpoint` is the one way generate.py, visualize.py and the export read a model. A
gptmini checkpoint is what Lightning saves for the training module (a `torch.save`d dict),
with the entries `write_model_entries` adds at every save:

    {"state_dict": {"model.<GPTModel key>": tensor, ...},
     "hyper_parameters": {"tokenizer": "gpt2", <GPTConfig fields>, <training settings>},
     "model_config": {<every GPTConfig field>},  # since padded_vocab_size; older ones lack it
     "tokenizer": {"format": ..., "name": ..., <tokens, unless GPT-2's>},  # older: gpt2
     "precision": "bf16-mixed",  # what a resume's --trainer.precision auto keeps
     ...Lightning's own keys (epoch, global_step, optimizer_states, loops, callbacks)...}

It is always read with `torch.load(weights_only=True)`: tensors, numbers, strings and
containers only, so a checkpoint cannot run code when it is opened. A directory in the
Hugging Face GPT-2 layout (config.json + weights) is read through `convert`.
"""

import pickle
import re
from dataclasses import fields
from pathlib import Path
from typing import NamedTuple

import tiktoken
import torch

from gptmini.chat import ChatTemplate, directory_template, settings_template
from gptmini.checkpoint.sharded import is_sharded, read_sharded, read_sharded_metadata
from gptmini.convert import (
    check_finite,
    config_of,
    directory_config,
    is_llama_architecture,
    load_hf,
    local_checkpoint,
    model_of,
    read_json_object,
)
from gptmini.convert.gguf import GgufContents, is_gguf, read_gguf
from gptmini.finetune import adapter_state, add_class_head, add_lora, base_fingerprint, merge_lora
from gptmini.model import GPTConfig, GPTModel
from gptmini.runtime import auto_dtype, resolve_device
from gptmini.tokenizer import (
    FORMAT,
    from_hf_tokenizer,
    get_tokenizer,
    tokenizer_from_dict,
    tokenizer_to_dict,
)

__all__ = [
    "CONFIG_FIELDS",
    "MODEL_PREFIX",
    "BUILT_IN",
    "LoadedModel",
    "check_readable",
    "check_vocabulary",
    "gguf_source",
    "load_checkpoint",
    "load_on_device",
    "model_config",
    "model_source",
    "read_checkpoint",
    "run_data_settings",
    "tokenizer_entry",
    "training_steps",
    "upgrade_fields",
    "write_model_entries",
]

CONFIG_FIELDS = tuple(f.name for f in fields(GPTConfig))
MODEL_PREFIX = "model."  # the LightningModule keeps the GPTModel as `self.model`
BUILT_IN = ("gpt2", "byte")
"""Tokenizer names that are one vocabulary wherever they are read."""
MLA_FIELDS = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
              "v_head_dim")
"""Multi-head latent attention's options, GPTConfig fields `mla_<name>` until
mixer_options held them."""


def upgrade_fields(saved: dict) -> dict:
    """GPTConfig fields saved by an older gptmini as today's: `mla_kv_lora_rank` and its
    four siblings (MLA in every attention layer) become layer_kinds' "mla" and
    mixer_options["mla"]. Other fields are returned as they are."""
    old = {name: saved.get(f"mla_{name}") for name in MLA_FIELDS}
    upgraded = {k: v for k, v in saved.items() if not k.startswith("mla_")}
    if old["kv_lora_rank"] is None:
        return upgraded
    kinds = upgraded.get("layer_kinds") or ["attention"] * upgraded["n_layers"]
    upgraded["layer_kinds"] = ["mla" if kind == "attention" else kind for kind in kinds]
    options = {name: value for name, value in old.items() if value is not None}
    upgraded["mixer_options"] = {**(upgraded.get("mixer_options") or {}), "mla": options}
    return upgraded


# The fields a config cannot do without; the others have defaults.
_REQUIRED = ("vocab_size", "context_length", "emb_dim", "n_heads", "n_layers")


class LoadedModel(NamedTuple):
    model: GPTModel
    """In eval mode, on the requested device."""
    tokenizer: tiktoken.Encoding
    hparams: dict
    """The checkpoint's hyper_parameters; for a Hugging Face directory, the GPTConfig fields."""


def load_checkpoint(
    path: str | Path, map_location: str | torch.device = "cpu", *, base: str | Path | None = None
) -> LoadedModel:
    """Rebuild a trained model and its tokenizer from `path`.

    A LoRA run's checkpoint holds its adapters alone: they are loaded onto the base they
    were trained on (the path the checkpoint names, or `base`), which must hold the same
    weights, and merged. A classifier's model has its class head as `out_head` (the
    class names are `hparams["classes"]`).

    Args:
        path: a gptmini `.ckpt` file, or a Hugging Face model directory (`config.json` and
            `model.safetensors` or `pytorch_model.bin`), or a GGUF file (gptmini.convert.gguf),
            or a model's name on the Hub (`org/name`, `org/name@revision`:
            gptmini.convert.local_checkpoint).
        map_location: device for the weights and the model.
        base: for a LoRA checkpoint, where its base is now, if it moved.

    Returns:
        (model in eval mode, tokenizer, hyper_parameters dict). A chat fine-tune's
        template, or a Hugging Face directory's, is `hparams["chat_template"]` (read it
        with `gptmini.finetune.chat.template_for`).

    Raises:
        FileNotFoundError: nothing at `path`.
        ValueError: the file is corrupt or truncated, needs arbitrary unpickling, is not a
            gptmini checkpoint, or its weights do not fit its configuration.
    """
    path = local_checkpoint(path)
    if not path.exists():
        raise FileNotFoundError(
            f"no checkpoint at {path}; pass the .ckpt file that train.py saved (look under "
            "the run's checkpoints/ directory), a Hugging Face model directory, or a model's "
            "name on the Hub (org/name)"
        )
    if torch.device(map_location).type != "cpu":  # else torch.load calls the file corrupt
        resolve_device(str(map_location))
    if path.is_dir() and not is_sharded(path):
        return _load_hf_directory(path, map_location)
    if is_gguf(path):
        return _load_gguf(path, map_location)

    ckpt = read_checkpoint(path, map_location)
    hparams = ckpt.get("hyper_parameters") if isinstance(ckpt, dict) else None
    state = ckpt.get("state_dict") if isinstance(ckpt, dict) else None
    if not isinstance(hparams, dict) or not isinstance(state, dict):
        found = sorted(ckpt)[:8] if isinstance(ckpt, dict) else type(ckpt).__name__
        raise ValueError(
            f"{path} is not a gptmini checkpoint: expected a dict with 'state_dict' and "
            f"'hyper_parameters' (what train.py saves), found {found}"
        )
    model_state = _model_state(state)
    if not model_state:
        raise ValueError(
            f"{path} is not a gptmini checkpoint: no '{MODEL_PREFIX}' weights in its state_dict "
            f"(first keys: {sorted(state)[:5]})"
        )
    try:
        tokenizer = tokenizer_from_dict(tokenizer_entry(ckpt), f"{path}'s tokenizer")
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from err
    try:
        check_vocabulary(ckpt, tokenizer)
        cfg = model_config(ckpt, tokenizer.n_vocab)
        check_finite(model_state, "its state_dict")
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path}: {err}") from err

    classes = hparams.get("classes")
    if ckpt.get("lora"):
        model = _adapted_model(cfg, model_state, ckpt["lora"], classes, path, base)
    else:
        model = _model_holding(cfg, model_state, path, classes)
    hparams = dict(hparams)
    if isinstance(ckpt.get("chat_template"), dict):  # a chat fine-tune's (finetune.chat)
        hparams["chat_template"] = ckpt["chat_template"]
    return LoadedModel(model.to(map_location).eval(), tokenizer, hparams)


def _adapted_model(cfg: GPTConfig, state: dict, lora: dict, classes: list[str] | None,
                   path: Path, base: str | Path | None) -> GPTModel:
    """A LoRA checkpoint's adapters (and class head) on their base, merged.

    Raises:
        FileNotFoundError: the base is not where the checkpoint (or `base`) says.
        ValueError: the base holds other weights than the adapters were trained on.
    """
    where = base or lora["base"]
    if not Path(where).exists():
        relative = "" if Path(where).is_absolute() else (
            f" (a relative path, as older runs saved it: read from {Path.cwd()}; run from the "
            "directory it was trained in)")
        raise FileNotFoundError(
            f"{path} holds LoRA adapters, trained on the base {lora['base']}, which is not "
            f"there{relative}: put the base back, or pass where it is now "
            "(load_checkpoint(path, base=...))")
    base_model = load_checkpoint(where).model
    found = base_fingerprint(base_model.state_dict())
    if found != lora["base_fingerprint"]:
        raise ValueError(
            f"{path} holds LoRA adapters trained on the base {lora['base']} (weights "
            f"{lora['base_fingerprint']}), not on {where} (weights {found}): load them onto "
            "the base they were trained on")
    model = GPTModel(cfg)
    weights = base_model.state_dict()
    if "pos_emb.weight" in weights:
        weights["pos_emb.weight"] = weights["pos_emb.weight"][: cfg.context_length]
    if classes:
        add_class_head(model, len(classes))
        weights = {k: v for k, v in weights.items() if not k.startswith("out_head.")}
    model.load_state_dict(weights, strict=False)
    add_lora(model, rank=lora["rank"], alpha=lora["alpha"], dropout=lora["dropout"],
             targets=lora["targets"])
    missing, unexpected = model.load_state_dict(state, strict=False)
    expected = set(adapter_state(model.state_dict())) | ({k for k in model.state_dict()
                                                          if k.startswith("out_head.")}
                                                         if classes else set())
    if expected & set(missing) or unexpected:
        raise ValueError(f"{path}: its adapters do not fit the model it describes (missing "
                         f"{sorted(expected & set(missing))[:3]}, unexpected "
                         f"{sorted(unexpected)[:3]})")
    return merge_lora(model).requires_grad_(True)


def model_source(path: str | Path) -> tuple[GPTConfig, tiktoken.Encoding]:
    """The architecture and the tokenizer of a model source without reading its weights: a
    gptmini checkpoint (memory-mapped), a Hugging Face model directory (its config.json and
    tokenizer.json), a GGUF file (its metadata) or a model's name on the Hub
    (`local_checkpoint`). What `--model.init_from` starts from.

    Raises:
        FileNotFoundError: nothing at `path`, or a directory without config.json.
        ValueError: a file that is not a gptmini checkpoint, or a config gptmini cannot load.
    """
    path = local_checkpoint(path)
    if not path.exists():
        raise FileNotFoundError(
            f"no model at {path}: pass a gptmini checkpoint (.ckpt, under a run's "
            "checkpoints/), a Hugging Face model directory, or a model's name on the Hub "
            "(org/name)")
    if path.is_dir() and not is_sharded(path):
        cfg = directory_config(path)
        tokenizer = _hf_directory_tokenizer(path, not is_llama_architecture(cfg))
        return cfg.fit_vocab(tokenizer.n_vocab), tokenizer
    if is_gguf(path):
        return gguf_source(path)[:2]
    ckpt = read_checkpoint(path, "cpu", mmap=True, weights=False)
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("hyper_parameters"), dict):
        raise ValueError(f"{path} is not a gptmini checkpoint (what train.py saves)")
    try:
        tokenizer = tokenizer_from_dict(tokenizer_entry(ckpt), f"{path}'s tokenizer")
        return model_config(ckpt, tokenizer.n_vocab), tokenizer
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path}: {err}") from err


def _load_hf_directory(path: Path, map_location: str | torch.device) -> LoadedModel:
    """`load_checkpoint` of a Hugging Face directory: its model, and its tokenizer.json
    (GPT-2's vocabulary for a GPT-2 directory without one)."""
    model = load_hf(path)
    tokenizer = _hf_directory_tokenizer(path, not is_llama_architecture(model.cfg))
    try:
        model.cfg = model.cfg.fit_vocab(tokenizer.n_vocab)  # same weights; padding is named
    except ValueError as err:
        raise ValueError(f"{path / 'tokenizer.json'} is not this model's: {err}") from None
    hparams = {**model.cfg.to_dict(), "tokenizer": "gpt2"}
    template = directory_template(path, tokenizer)
    if template is not None:
        hparams["chat_template"] = template.to_dict()
    return LoadedModel(model.to(map_location).eval(), tokenizer, hparams)


def _load_gguf(path: Path, map_location: str | torch.device) -> LoadedModel:
    """`load_checkpoint` of a GGUF file: its model, dequantized to float32, its vocabulary
    and its chat template."""
    contents = read_gguf(path)
    model = model_of(contents.hf_config, contents.state, path)
    model.cfg = model.cfg.fit_vocab(contents.tokenizer.n_vocab)
    hparams = {**model.cfg.to_dict(), "tokenizer": "gpt2"}
    template = _gguf_template(path, contents)
    if template is not None:
        hparams["chat_template"] = template.to_dict()
    return LoadedModel(model.to(map_location).eval(), contents.tokenizer, hparams)


def gguf_source(path: Path) -> tuple[GPTConfig, tiktoken.Encoding, ChatTemplate | None]:
    """A GGUF file's architecture, vocabulary and chat template from one reading of its
    metadata (opening the file parses every field: seconds for a real model)."""
    contents = read_gguf(path, weights=False)
    cfg = config_of(contents.hf_config, path)
    return (cfg.fit_vocab(contents.tokenizer.n_vocab), contents.tokenizer,
            _gguf_template(path, contents))


def _gguf_template(path: Path, contents: GgufContents) -> ChatTemplate | None:
    """A GGUF file's chat template (`tokenizer.chat_template`), ending at its eos token."""
    return settings_template(path.stem, contents.tokenizer_config, [], contents.tokenizer,
                             path)


def _model_holding(cfg: GPTConfig, model_state: dict, path: Path,
                   classes: list[str] | None = None) -> GPTModel:
    """A GPTModel of `cfg` (with a class head for `classes`) holding a checkpoint's weights,
    or an error naming what differs."""
    model = GPTModel(cfg)
    if classes:
        add_class_head(model, len(classes))
    elif cfg.tie_weights and "out_head.weight" not in model_state:
        # One copy is enough for a tied head; some writers keep only the embedding.
        model_state["out_head.weight"] = model_state.get("tok_emb.weight")
    try:
        model.load_state_dict(model_state, strict=True)
    except RuntimeError as err:
        problems = [line.strip() for line in str(err).splitlines()[1:] if line.strip()]
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ValueError(
            f"{path}: the weights do not match the model its hyper_parameters describe "
            f"({cfg}): {'; '.join(problems[:3])}{more}"
        ) from None
    return model


def load_on_device(path: str | Path, device: torch.device | str, dtype: str) -> LoadedModel:
    """`load_checkpoint` onto `device`, in `dtype` (a name `gptmini.runtime.auto_dtype` takes:
    auto, float32, bfloat16, float64): the language model that generate.py and serve.py
    write text with, from --checkpoint, --device and --dtype.

    Raises:
        ValueError: a classifier (its head scores classes, not tokens), or what
            `load_checkpoint` refuses.
    """
    model, tokenizer, hparams = load_checkpoint(path, map_location=device)
    if hparams.get("classes"):
        raise ValueError(
            f"{path} is a classifier (classes {', '.join(map(str, hparams['classes']))}): its "
            "head scores classes, not tokens, so it writes no text; score it with "
            f"evaluate.py --checkpoint {path} (--data a labelled file), or in Python with "
            "gptmini.finetune.class_logits")
    return LoadedModel(model.to(auto_dtype(dtype, device)), tokenizer, hparams)


def training_steps(path: str | Path) -> int | None:
    """The optimizer steps a gptmini checkpoint was saved after (Lightning's `global_step`);
    None for a Hugging Face directory, a GGUF file or a file without the count. Memory-maps
    the file, so a large checkpoint is not read twice."""
    path = Path(path)
    if (path.is_dir() and not is_sharded(path)) or is_gguf(path):
        return None
    ckpt = read_checkpoint(path, mmap=True, weights=False)
    step = ckpt.get("global_step") if isinstance(ckpt, dict) else None
    return step if isinstance(step, int) else None


def run_data_settings(path: str | Path) -> dict:
    """The data settings a train.py checkpoint was trained with ({} for other models: a
    Hugging Face directory, a Hub name's, a GGUF file)."""
    path = local_checkpoint(path)
    if path.is_dir() or is_gguf(path):
        return {}
    ckpt = read_checkpoint(path, "cpu", mmap=True, weights=False)
    return dict(ckpt.get("datamodule_hyper_parameters") or {})


def _hf_directory_tokenizer(path: Path, gpt2_layout: bool) -> tiktoken.Encoding:
    """A directory's tokenizer.json as tiktoken's; GPT-2's vocabulary for a GPT-2 directory
    without one (as the hub's gpt2 ships it)."""
    hf_tokenizer = path / "tokenizer.json"
    if not hf_tokenizer.is_file():
        if gpt2_layout:
            return get_tokenizer("gpt2")
        raise ValueError(f"{path} has no tokenizer.json: a Llama directory brings its own "
                         "vocabulary, and no other would fit its embeddings")
    data = read_json_object(hf_tokenizer, "a Hugging Face tokenizer")
    try:
        return from_hf_tokenizer(data, path.name)
    except (ValueError, TypeError, AttributeError, KeyError) as err:
        model = data.get("model")
        kind = model.get("type", "unknown") if isinstance(model, dict) else "unknown"
        raise ValueError(
            f"{hf_tokenizer} cannot be used: gptmini encodes text with tiktoken, which "
            f"represents byte-level BPE vocabularies only (GPT-2's, Llama 3's), and this one "
            f"is a {kind} model without them ({err}); SentencePiece vocabularies such as "
            "Llama 2's have no tiktoken form. Load the weights with "
            "gptmini.convert.load_hf and tokenize with the directory's own tokenizer"
        ) from None


def write_model_entries(checkpoint: dict, cfg: GPTConfig, tokenizer: tiktoken.Encoding,
                        precision: str) -> None:
    """Add to a checkpoint being saved what rebuilds its model without the training code:
    the whole config, the vocabulary itself (by name for GPT-2's), and the precision."""
    checkpoint["model_config"] = cfg.to_dict()
    checkpoint["tokenizer"] = tokenizer_to_dict(tokenizer)
    checkpoint["precision"] = precision


def tokenizer_entry(ckpt: dict) -> dict:
    """A checkpoint's tokenizer entry (`tokenizer_from_dict` rebuilds it). Checkpoints hold
    their vocabulary; older ones only its name in hyper_parameters, and GPT-2's at first."""
    saved = ckpt.get("tokenizer")
    if saved is not None:
        return saved
    return {"format": FORMAT, "name": str(ckpt.get("hyper_parameters", {}).get("tokenizer",
                                                                              "gpt2"))}


def check_vocabulary(ckpt: dict, tokenizer: tiktoken.Encoding) -> None:
    """Refuse a checkpoint whose tokenizer is not the one its model was trained with: a
    model scored or sampled through another vocabulary gives wrong numbers and text without
    any error.

    The whole model config (checkpoints since padded_vocab_size) holds the model's true
    vocab_size, which the tokenizer's count must equal (padding is padded_vocab_size); the
    hyper_parameters name the tokenizer the run was given, which a built-in name ("gpt2",
    "byte") pins.

    Raises:
        ValueError: naming both vocabularies and the fix.
    """
    saved = ckpt.get("model_config")
    hparams = ckpt.get("hyper_parameters") or {}
    vocab_size = saved.get("vocab_size") if isinstance(saved, dict) else None
    fix = ("the file was assembled from two runs or edited; take the checkpoint as train.py "
           "saved it, or re-save it with the tokenizer its model was trained with")
    if isinstance(vocab_size, int) and vocab_size != tokenizer.n_vocab:
        raise ValueError(
            f"its model was trained for {vocab_size:,} token ids (model_config.vocab_size) but "
            f"the tokenizer it carries, {tokenizer.name!r}, has {tokenizer.n_vocab:,}: {fix}")
    trained_with = hparams.get("tokenizer")
    if trained_with in BUILT_IN and trained_with != tokenizer.name:
        raise ValueError(
            f"its model was trained with --model.tokenizer {trained_with} but the tokenizer "
            f"it carries is {tokenizer.name!r} ({tokenizer.n_vocab:,} ids): {fix}")


def model_config(ckpt: dict, n_vocab: int) -> GPTConfig:
    """The `GPTConfig` a checkpoint was trained with, for a tokenizer of `n_vocab` ids.

    Newer checkpoints carry it whole ("model_config"); older ones only as hyper_parameters,
    where a vocab_size wider than the tokenizer was padding (see `GPTConfig.fit_vocab`).

    Raises:
        ValueError: the fields are missing or do not make a valid GPTConfig.
    """
    saved = ckpt.get("model_config") or ckpt.get("hyper_parameters") or {}
    missing = [name for name in _REQUIRED if name not in saved]
    if missing:
        raise ValueError(
            f"not a gptmini checkpoint: its hyper_parameters lack the GPTConfig fields "
            f"{missing}, so the model cannot be rebuilt (was it saved by another "
            "LightningModule?)"
        )
    try:
        saved = upgrade_fields(saved)
        cfg = GPTConfig(**{k: saved[k] for k in CONFIG_FIELDS if k in saved})
    except (TypeError, ValueError) as err:
        raise ValueError(f"its hyper_parameters do not make a GPTConfig: {err}") from err
    return cfg.fit_vocab(n_vocab)


def read_checkpoint(path: str | Path, map_location="cpu", *, mmap: bool = False,
                    weights: bool = True) -> object:
    """`torch.load` with weights only: tensors, numbers, strings and containers; a sharded
    checkpoint's directory is read whole (`gptmini.checkpoint.sharded.read_sharded`), or
    with `weights` False without its weights and optimizer states (its meta.pt: cheap, as a
    memory-mapped file is).

    Raises:
        ValueError: the file is truncated, not a PyTorch checkpoint, or needs arbitrary
            code to load (which is refused), naming the path and the fix.
    """
    path = Path(path)
    if is_sharded(path):
        checkpoint = read_sharded(path) if weights else read_sharded_metadata(path)
        if map_location != "cpu":
            checkpoint["state_dict"] = {k: v.to(map_location)
                                        for k, v in checkpoint.get("state_dict", {}).items()}
        return checkpoint
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        # The weights-only unpickler names the global (a class or function) it would have had
        # to import: only full unpickling rebuilds it, and that can run any code. Damaged
        # bytes fail it too, naming an opcode instead.
        found = re.search(r"GLOBAL ([\w.]+)", str(err))
        if found is None:
            raise _corrupt(path, err) from None
        raise ValueError(
            f"refusing to load {path}: it needs arbitrary code to load ({found.group(1)}), "
            "which could run anything on this machine, so it was refused. gptmini "
            "checkpoints hold only tensors, numbers and strings; if you trust where it came "
            "from, re-save it with plain values"
        ) from None
    except Exception as err:  # torch reports damaged files as RuntimeError, EOFError, ...
        raise _corrupt(path, err) from None


def check_readable(path: str | Path) -> None:
    """Fail now, with a clear message, if `path` is not a checkpoint torch can read safely.

    Memory-maps the file (reads a sharded checkpoint's meta.pt alone), so even a large
    checkpoint costs little to check.

    Raises:
        ValueError: the file is truncated, not a PyTorch checkpoint, or needs arbitrary code.
    """
    read_checkpoint(path, "cpu", mmap=True, weights=False)


def _corrupt(path: Path, err: Exception) -> ValueError:
    return ValueError(
        f"cannot read {path}: it is corrupt, truncated or not a PyTorch checkpoint "
        f"({type(err).__name__}: {str(err)[:200]}); re-copy it or pick another .ckpt"
    )


def _model_state(state: dict) -> dict:
    """GPTModel keys from the training module's state_dict."""
    out = {}
    for key, value in state.items():
        if key.startswith(MODEL_PREFIX):
            key = key[len(MODEL_PREFIX):]
            # torch.compile wraps the module; its keys gain this prefix.
            key = key.removeprefix("_orig_mod.")
            out[key] = value
    return out
