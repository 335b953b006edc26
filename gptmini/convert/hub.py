"""Hugging Face model directories on disk: `config.json` plus `model.safetensors` (or
`pytorch_model.bin`), read into a GPTModel and written from one, the layout picked by the
config; and a model named on the Hub (`org/name`, `org/name@revision`) as its directory in
huggingface_hub's cache (`local_checkpoint`)."""

import json
import os
import re
import stat
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tiktoken import Encoding
from torch import Tensor

from gptmini.convert.deepseek import LAYOUTS as DEEPSEEK_LAYOUTS
from gptmini.convert.gemma import LAYOUTS as GEMMA_LAYOUTS
from gptmini.convert.gpt2 import LAYOUTS as GPT2_LAYOUTS
from gptmini.convert.gptoss import LAYOUTS as GPT_OSS_LAYOUTS
from gptmini.convert.llama import LAYOUTS as LLAMA_LAYOUTS
from gptmini.convert.llama import is_llama_architecture
from gptmini.convert.qwen3_5 import LAYOUTS as QWEN3_5_LAYOUTS
from gptmini.convert.staging import staged_directory
from gptmini.convert.weights import check_finite, check_float_weights
from gptmini.model import GPTConfig, GPTModel
from gptmini.tokenizer import to_hf_tokenizer

__all__ = ["LAYOUTS", "config_of", "export_hf", "export_layout", "load_hf", "local_checkpoint",
           "model_of", "model_type", "read_hf_config", "read_hf_weights", "read_json_object",
           "write_tokenizer_files"]


LAYOUTS = {**GPT2_LAYOUTS, **LLAMA_LAYOUTS, **DEEPSEEK_LAYOUTS, **GEMMA_LAYOUTS,
           **GPT_OSS_LAYOUTS, **QWEN3_5_LAYOUTS}
"""The `model_type`s gptmini reads and writes, each a `Layout` its module lists (GPT-2's;
Llama's and Qwen3's, Llama's layout with QK-norm; DeepSeek-V3's, multi-head latent
attention, every layer dense; Gemma 3's text model; gpt-oss's; Qwen3.5's text model)."""


HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?")
"""A model's name on the Hub, `org/name` with an optional `@revision` (a branch, tag or
commit), as a checkpoint path that is not on disk may give it."""
HUB_GGUF = re.compile(r"([A-Za-z0-9][\w.-]*/[\w.-]+)(?:@([\w.-]+))?/([\w./-]+\.gguf)")
"""One GGUF file of a Hub repository: `org/name/file.gguf`, `org/name@revision/file.gguf`
(GGUF repositories hold one file per quantization)."""
HUB_FILES = ["config.json", "*.safetensors", "model.safetensors.index.json",
             "pytorch_model.bin", "tokenizer.json", "tokenizer_config.json",
             "special_tokens_map.json", "generation_config.json", "chat_template.jinja"]
"""What of a Hub repository gptmini reads for a model's name (not its other formats: ONNX,
GGUF, ...; a GGUF file is named by its path in the repository)."""


def local_checkpoint(path: str | Path) -> Path:
    """`path` where it is on disk; else, for a Hub name (`org/name[@revision]`), its
    snapshot in huggingface_hub's cache (HF_HOME, HF_HUB_CACHE), downloaded first unless
    HF_HUB_OFFLINE=1 says to read the cache alone; for a GGUF file of a Hub repository
    (`org/name[@revision]/file.gguf`), that file in the cache. Any other path is returned
    as it is (its reader says it is missing).

    Raises:
        FileNotFoundError: offline (or unreachable) and not cached, or a cached snapshot
            without config.json or weights, naming what is missing and the fix.
        ValueError: no such repository, revision or file, or a gated or private repository
            (saying how to log in).
    """
    local = Path(path)
    if local.exists():
        return local
    if gguf := HUB_GGUF.fullmatch(str(path)):
        repo, revision, filename = gguf.groups()
        from huggingface_hub import hf_hub_download

        return _from_hub(path, repo, revision, lambda offline: hf_hub_download(
            repo, filename, revision=revision, local_files_only=offline))
    if not HUB_NAME.fullmatch(str(path)):
        return local
    repo, _, revision = str(path).partition("@")
    from huggingface_hub import snapshot_download

    directory = _from_hub(path, repo, revision, lambda offline: snapshot_download(
        repo, revision=revision or None, allow_patterns=HUB_FILES, local_files_only=offline))
    missing = [name for name, found in (
        ("config.json", (directory / "config.json").is_file()),
        ("weights (model.safetensors, its index, or pytorch_model.bin)",
         any((directory / f).is_file() for f in ("model.safetensors",
                                                   "model.safetensors.index.json",
                                                   "pytorch_model.bin")))) if not found]
    if missing:
        raise FileNotFoundError(
            f"the cached snapshot of {path} ({directory}) has no {' and no '.join(missing)}: "
            "download it again online (unset HF_HUB_OFFLINE), or it holds another format "
            "gptmini does not read (a GGUF file: name it, org/name/file.gguf)")
    return directory


def _from_hub(path: str | Path, repo: str, revision: str | None, fetch) -> Path:
    """`fetch(offline)`'s path in huggingface_hub's cache, its failures named with their fix."""
    from huggingface_hub import constants, errors

    login = ("log in first: `hf auth login`, or set HF_TOKEN to a token of an account that "
             "may read it")
    try:
        return Path(fetch(constants.HF_HUB_OFFLINE))
    except errors.GatedRepoError:
        raise ValueError(f"{repo} is gated on the Hugging Face Hub: accept its terms on "
                         f"https://huggingface.co/{repo}, then {login}") from None
    except errors.RevisionNotFoundError:
        raise ValueError(f"{repo} has no revision {revision!r} on the Hub: name a branch, tag "
                         "or commit it has (org/name@main)") from None
    except errors.RepositoryNotFoundError:
        raise ValueError(f"no model {repo} on the Hugging Face Hub, or a private one: check "
                         f"the name, or {login}") from None
    except errors.LocalEntryNotFoundError:
        why = ("HF_HUB_OFFLINE=1 reads the cache alone" if constants.HF_HUB_OFFLINE
               else "the Hub could not be reached")
        raise FileNotFoundError(
            f"{path} is neither a file here nor in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}), and {why}: download it once online (unset "
            f"HF_HUB_OFFLINE), or pass a local .ckpt or model directory") from None
    except errors.EntryNotFoundError:  # (after its offline kind, LocalEntryNotFoundError)
        raise ValueError(f"{repo} has no file {Path(str(path)).name!r} on the Hub: name one "
                         f"it lists on https://huggingface.co/{repo}/tree/main") from None


def export_layout(model: GPTModel) -> str:
    """The layout `model` exports as: the one its layers' mixers or its feed-forward name
    (`hf_layout`: multi-head latent attention's is DeepSeek-V3's), else Llama's for a model
    of Llama's architecture and GPT-2's for any other (whose checks name what does not fit).

    Raises:
        ValueError: its parts name two layouts.
    """
    named = {part.hf_layout for part in (*model.mixers, model.feed_forward)} - {None}
    if len(named) > 1:
        raise ValueError(f"this model's layers belong to {len(named)} Hugging Face layouts "
                         f"({', '.join(sorted(named))}); no one layout holds it")
    if named:
        return named.pop()
    return "llama" if is_llama_architecture(model.cfg) else "gpt2"  # by their frames


def load_hf(directory: str | Path) -> GPTModel:
    """A `GPTModel` (eval mode) from a local `save_pretrained` directory of a layout in
    `LAYOUTS` (GPT-2, Llama, Qwen3(-MoE), DeepSeek-V3, Gemma 3's and Qwen3.5's text models,
    gpt-oss).

    Raises:
        FileNotFoundError: no config.json or no weights.
        ValueError: naming the file and the field: a config of another architecture, a
            field gptmini cannot read or compute, weights that are damaged, quantized or
            not finite.
    """
    directory = Path(directory)
    # The config first: a directory of another architecture is not read further.
    directory_config(directory)
    hf_config, state = read_hf_weights(directory)
    return model_of(hf_config, state, directory)


def model_of(hf_config: dict, state: dict[str, Tensor], where: str | Path) -> GPTModel:
    """A `GPTModel` (eval mode) of a config.json dict and a state dict of its layout (read
    from `where`, which errors name).

    Raises:
        ValueError: as `load_hf`.
    """
    try:
        return LAYOUTS[model_type(hf_config)].model_from(state, hf_config)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def config_of(hf_config: dict, where: str | Path) -> GPTConfig:
    """The `GPTConfig` of a config.json dict (read from `where`, which errors name).

    Raises:
        ValueError: as `load_hf`.
    """
    try:
        return LAYOUTS[model_type(hf_config)].config_from(hf_config)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def directory_config(directory: str | Path) -> GPTConfig:
    """The `GPTConfig` a Hugging Face directory's config.json describes (a layout in
    `LAYOUTS`), without reading its weights.

    Raises:
        FileNotFoundError: no config.json.
        ValueError: naming the file and the field, as `load_hf`.
    """
    directory = Path(directory)
    return config_of(read_hf_config(directory), directory / "config.json")


def model_type(hf_config: dict) -> str:
    """Which of `LAYOUTS` a config.json describes: its `model_type`, else its
    `architectures` (GPT-2's when it names neither, as the oldest GPT-2 configs).

    Raises:
        ValueError: another architecture (DeepSeek's, Mistral's, ...), named.
    """
    kind = hf_config.get("model_type")
    architectures = hf_config.get("architectures") or []
    if kind is None and isinstance(architectures, list) and architectures:
        matches = [k for k, layout in LAYOUTS.items()
                   if str(architectures[0]).startswith(layout.architecture)]
        # the longest start: Qwen3Moe... is not Qwen3's
        kind = max(matches, key=lambda k: len(LAYOUTS[k].architecture), default=architectures[0])
    kind = "gpt2" if kind is None else kind
    if not isinstance(kind, str) or kind not in LAYOUTS:
        raise ValueError(
            f"it describes a model_type={hf_config.get('model_type')!r} "
            f"(architectures {architectures!r}) model, which gptmini does not read: it reads "
            f"{', '.join(f'{k!r} ({v.title})' for k, v in LAYOUTS.items())} directories")
    return kind


def read_hf_config(directory: Path) -> dict:
    """A Hugging Face directory's config.json.

    Raises:
        FileNotFoundError: there is none.
        ValueError: it is not a JSON object.
    """
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(
            f"{directory} is not a Hugging Face model directory: no config.json "
            "(save one with save_pretrained or gptmini.convert.export_hf)"
        )
    return read_json_object(config_path, "a Hugging Face model config")


def read_json_object(path: Path, what: str) -> dict:
    """The JSON object in `path` (`what` it is, for the error).

    Raises:
        ValueError: the file is not UTF-8 JSON, or holds something other than an object.
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not JSON ({err}); it should be {what}: download or "
                         "export it again") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a JSON {type(data).__name__}, not an object; it "
                         f"should be {what}: download or export it again")
    return data


def read_hf_weights(directory: str | Path) -> tuple[dict, dict[str, Tensor]]:
    """`config.json` and the weights of a Hugging Face directory: `model.safetensors` (or a
    sharded `model.safetensors.index.json`, or `pytorch_model.bin` with weights only).

    Raises:
        FileNotFoundError: no config.json, or no weights.
        ValueError: a file is damaged or not JSON; the weights are quantized (integer or
            8-bit) or hold NaN or infinity (each named).
    """
    directory = Path(directory)
    hf_config = read_hf_config(directory)
    single, index = directory / "model.safetensors", directory / "model.safetensors.index.json"
    bin_file = directory / "pytorch_model.bin"
    try:
        if single.is_file():
            state = load_file(single)
        elif index.is_file():
            weight_map = read_json_object(index, "a safetensors index").get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index} has no 'weight_map' object")
            shards = sorted(set(map(str, weight_map.values())))
            state = {k: v for shard in shards for k, v in load_file(directory / shard).items()}
        elif bin_file.is_file():
            state = torch.load(bin_file, map_location="cpu", weights_only=True)
        else:
            raise FileNotFoundError(
                f"{directory} has config.json but no weights (model.safetensors or "
                "pytorch_model.bin)"
            )
    except (OSError, ValueError, RuntimeError, SafetensorError) as err:
        if isinstance(err, FileNotFoundError):
            raise
        raise ValueError(
            f"cannot read the weights in {directory}: they are truncated or damaged "
            f"({type(err).__name__}: {str(err)[:200]}); download them again"
        ) from None
    where = f"the directory {directory}"
    check_float_weights(state, where)
    check_finite(state, where)
    return hf_config, state


def export_hf(model: GPTModel, directory: str | Path, tokenizer: Encoding | None = None
              ) -> Path:
    """Write `model` as a GPT-2 directory that `transformers` loads (a model of Llama's
    architecture, rotary + SwiGLU, as a `LlamaForCausalLM` directory: gptmini.convert.llama;
    one of multi-head latent attention as a dense `DeepseekV3ForCausalLM` directory:
    gptmini.convert.deepseek; one of GeGLU as a `Gemma3ForCausalLM` directory:
    gptmini.convert.gemma).

    The directory holds `config.json` and `model.safetensors`, and
    `transformers.GPT2LMHeadModel.from_pretrained(directory)` loads it. With `tokenizer`,
    also its `tokenizer.json` and `tokenizer_config.json`, so that
    `AutoTokenizer.from_pretrained(directory)` encodes text to the ids the model was
    trained on (and `load_checkpoint(directory)` reads the vocabulary back). A checkpoint
    carries both: `loaded = load_checkpoint(path); export_hf(loaded.model, directory,
    loaded.tokenizer)`.

    The directory is written whole or not at all (gptmini.convert.staging): beside the
    target first, then swapped in, so a failure (a full disk) leaves an earlier export there
    as it was, and nothing of another model (its tokenizer.json) stays beside the new one.

    Raises:
        ValueError: the model has options its layout lacks (each named: grouped-query or
            sliding-window attention in GPT-2's, biases in Llama's or DeepSeek-V3's), or
            `tokenizer` does not have the model's number of ids, or `directory` holds other
            files than a model's.
        OSError: the directory could not be written (the earlier one is unchanged).
    """
    layout = LAYOUTS[export_layout(model)]
    hf_config, state = layout.config_to(model.cfg), layout.state_to(model)
    state = {k: v.cpu() for k, v in state.items()}
    directory = Path(directory)
    try:
        with staged_directory(directory) as stage:
            if tokenizer is not None:
                write_tokenizer_files(model, tokenizer, stage, hf_config)
            config = stage / "config.json"
            config.write_text(json.dumps(hf_config, indent=2) + "\n")
            weights = stage / "model.safetensors"
            save_file(state, weights, metadata={"format": "pt"})
            # safetensors writes 0600 whatever the umask; the rest is 0644 under the usual one.
            os.chmod(weights, stat.S_IMODE(config.stat().st_mode))
    except (OSError, SafetensorError) as err:
        reason = getattr(err, "strerror", None) or str(err)
        raise OSError(
            f"could not write the export {directory} ({reason}); what was there is "
            "unchanged. Free space, or pick a writable place, then export again") from err
    return directory


def write_tokenizer_files(model: GPTModel, tokenizer: Encoding, directory: Path,
                          hf_config: dict) -> None:
    """`tokenizer.json` and `tokenizer_config.json` for `AutoTokenizer`, and the end token
    as the config's bos/eos ids.

    Raises:
        ValueError: `tokenizer` does not have the model's number of ids.
    """
    if tokenizer.n_vocab != model.cfg.vocab_size:
        raise ValueError(
            f"the tokenizer {tokenizer.name!r} has {tokenizer.n_vocab} ids but the model "
            f"{model.cfg.vocab_size}: export the tokenizer the model was trained with "
            "(load_checkpoint(path).tokenizer)"
        )
    hf_config.update(bos_token_id=tokenizer.eot_token, eos_token_id=tokenizer.eot_token)
    (directory / "tokenizer.json").write_text(json.dumps(to_hf_tokenizer(tokenizer)))
    end = tokenizer.decode_single_token_bytes(tokenizer.eot_token).decode()
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": end,
                "eos_token": end, "model_max_length": model.cfg.context_length}
    (directory / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")
