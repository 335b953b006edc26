"""A run resolved once: the plan train.py works out before it builds anything.

The settings name things (a tokenizer, "auto" precision, a source to start from, a chat
template, labelled records); `plan_run` turns each into what it is, once and in this one
place, in the order each depends on the last:

    precision       "auto": the checkpoint's when resuming, else bf16 where the device has it
    steps           --cpu_float32_steps instead of --trainer.max_steps where a CPU trains in
                    float32 (no bf16 units) and the steps were not given: the default run's,
                    and there --cpu_float32_compile for --model.compile; then at most
                    --max_corpus_epochs passes over a small corpus
    source          --model.init_from read (`Source`): its architecture fills the model
                    settings not given, and a setting that contradicts it is refused
    tokenizer       a resume's own, the source's, a fitted bpe:N, or the one named
    classes         a classification run's, from its training records unless given
    post-training   preference pairs: a DPO run (--model.dpo); a verifiable task: an RL
                    run (--model.grpo) and the task's checker, loaded once
    chat template   "auto": the source's own, else the book's (Alpaca records, the book's
                    pairs) or gptmini's (chat records, RL prompts); the tokens it adds grow
                    the tokenizer

The LightningModule and the DataModule receive the plan's objects (train.py hands them
over); the config is rewritten with what each resolved to (a saved tokenizer's path, the
template, the precision), so the run's saved config, its hparams and --print_config read
as the run that trained.
"""

import json
import math
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass
from pathlib import Path

import tiktoken
import torch
from jsonargparse import Namespace

from gptmini.chat import (
    AUTO,
    TEMPLATES,
    ChatTemplate,
    add_template_tokens,
    choose_template,
    is_alpaca,
)
from gptmini.checkpoint import CONFIG_FIELDS, read_checkpoint, tokenizer_entry
from gptmini.data import Corpus, GPTDataModule
from gptmini.data.chat import Chat, read_chat_records
from gptmini.data.labels import Labels
from gptmini.data.preference import Preference, is_book_layout, read_pairs
from gptmini.data.rl import RL
from gptmini.data.verifiable import VerifiableTask
from gptmini.data.vocab import parse_bpe
from gptmini.finetune.dpo import DPO
from gptmini.runtime import AUTO as AUTO_PRECISION
from gptmini.runtime import auto_precision, precision_dtype
from gptmini.tokenizer import (
    get_tokenizer,
    load_tokenizer,
    save_tokenizer,
    tokenizer_fingerprint,
    tokenizer_from_dict,
)
from gptmini.train.source import CHANGEABLE_FIELDS, Source, contradictions
from gptmini.train.tasks import GRPOSettings

Say = Callable[[str], None]
"""Prints a line of what was decided (rank 0 only)."""


@dataclass(frozen=True)
class RunPlan:
    """What a run is, resolved once.

    Attributes:
        tokenizer: the run's vocabulary (a chat template's tokens included).
        precision: Lightning's precision ("bf16-mixed", "32-true", ...).
        source: the model the run starts from (--model.init_from), or None.
        chat_template: what a fine-tune on records renders them with, or None.
        classes: a classifier's class names, in its head's order, or None.
        context_length: the model's, which the data's windows follow.
        verifier: an RL run's task, whose checker rewards the samples, or None.
    """

    tokenizer: tiktoken.Encoding
    precision: str
    source: Source | None
    chat_template: ChatTemplate | None
    classes: tuple[str, ...] | None
    context_length: int
    verifier: VerifiableTask | None = None


def plan_run(config, run: Path, given: Collection[str], say: Say,
             trainer_given: Collection[str] = ()) -> RunPlan:
    """Resolve the run `config` (train.py's parsed settings) describes, and write what each
    setting resolved to back into `config`.

    Args:
        run: the run's directory (a fitted or grown vocabulary and a source's chat
            template are saved there).
        given: the model settings this invocation sets (on the command line, or to a value
            other than the default run's): the ones a source must not contradict.
        say: prints a line of what was decided.
        trainer_given: the trainer settings this invocation sets, likewise.

    Raises:
        ValueError: a setting that contradicts another or the source, naming both.
    """
    resumed = resumed_checkpoint(config.ckpt_path, run)
    precision = plan_precision(config.trainer, resumed, say)
    plan_steps(config, precision, trainer_given, say)
    plan_compile(config, precision, given, say)
    source = plan_source(config, resumed, given)
    tokenizer = plan_tokenizer(config, resumed, source, given, run, say)
    plan_epochs(config, trainer_given, say)
    classes = plan_classes(config)
    verifier = plan_posttraining(config, say)
    template, tokenizer = plan_chat(config, tokenizer, source, run)
    return RunPlan(tokenizer, precision, source, template, classes, config.model.context_length,
                   verifier)


def resumed_checkpoint(ckpt_path: str | None, run: Path) -> dict:
    """The checkpoint to resume, memory-mapped ({}: none, or unreadable; fit() reports an
    unreadable one)."""
    if ckpt_path is None:
        return {}
    path = run / "checkpoints" / "last.ckpt" if ckpt_path == "last" else Path(ckpt_path)
    try:  # a sharded checkpoint's meta.pt alone: its shards load when the run resumes
        return read_checkpoint(path, "cpu", mmap=True, weights=False)
    except (ValueError, FileNotFoundError):
        return {}


def plan_precision(trainer, checkpoint: dict, say: Say) -> str:
    """--trainer.precision; "auto" decided here and said: a resumed run keeps the precision
    its checkpoint was trained in, on whatever machine it resumes."""
    if trainer.precision != AUTO_PRECISION:
        return str(trainer.precision)
    saved = checkpoint.get("precision")
    if saved is not None:
        trainer.precision, why = saved, "kept from the checkpoint being resumed"
    else:
        trainer.precision, why = auto_precision(trainer.accelerator)
    say(f"precision: {trainer.precision} (auto: {why})")
    return trainer.precision


def plan_steps(config, precision: str, trainer_given: Collection[str], say: Say) -> None:
    """--cpu_float32_steps: the default run's step count where a CPU trains in float32.

    The default recipe was timed with bf16 matmuls (AVX512-BF16 or AMX); a CPU without them
    (AVX2 alone) trains it in float32, about half as fast: with AVX2 forced on a 2-core AMD
    EPYC, 0.70 s a step against 0.37 in bf16, 12 minutes for the 960 steps (docs/recipes.md);
    a real AVX2-only Zen 3 steps about twice as slowly again. The count follows from the CPU
    and the precision alone, never from a clock, so the same command on the same machine
    trains the same weights (a resume included: it keeps its checkpoint's precision).
    --trainer.max_steps given wins."""
    steps = config.get("cpu_float32_steps")
    if steps is None or "max_steps" in trainer_given or not float32_on_cpu(config, precision):
        return
    config.trainer.max_steps = steps
    say(f"steps: {steps} (--cpu_float32_steps: this CPU trains in float32, about half as "
        f"fast as the bf16 the recipe was timed in; --trainer.max_steps N trains N)")


def plan_compile(config, precision: str, given: Collection[str], say: Say) -> None:
    """--cpu_float32_compile: --model.compile where a CPU trains in float32.

    Compiling pays in bf16 (fused casts and norms) but hardly in float32, where the matmuls
    are the step: the run finished sooner eager, its first compiled step costing more than
    the rest saved (measured in docs/benchmarks.md, "The default run beside other work").
    --model.compile given wins."""
    choice = config.get("cpu_float32_compile")
    if (choice is None or "compile" in given or config.model.compile == choice
            or not float32_on_cpu(config, precision)):
        return
    config.model.compile = choice
    say(f"compile: {'on' if choice else 'off'} (--cpu_float32_compile "
        f"{str(choice).lower()}: in float32 on a CPU the matmuls are the step, which "
        f"compiling leaves as they are; --model.compile {str(not choice).lower()} overrides)")


def float32_on_cpu(config, precision: str) -> bool:
    """Whether the run trains in float32 on the CPU (one without bf16 units, or asked to)."""
    return on_cpu(config.trainer.accelerator) and precision_dtype(precision) == torch.float32


def plan_epochs(config, trainer_given: Collection[str], say: Say) -> None:
    """--max_corpus_epochs: the run's steps capped at that many passes over its training
    tokens, where --trainer.max_steps was not given (the default run's).

    The recipe's steps see the embedded corpus about twice; a user's 1 MB corpus (about 300k
    tokens) would see it six to ten times and overfit (docs/recipes.md, "A small corpus").
    The count follows from the tokens, the batch and the devices alone, never from a clock,
    so the same command on the same machine trains the same weights. Records (chat, pairs,
    labels, prompts) are not a corpus: their runs keep their steps."""
    epochs, data = config.get("max_corpus_epochs"), config.data
    if epochs is None or "max_steps" in trainer_given:
        return
    parts = ((Labels, data.labels), (Chat, data.chat), (Preference, data.preference), (RL, data.rl))
    if any(kind(**part.as_dict()).active for kind, part in parts):
        return
    corpus = Corpus(**{**data.corpus.as_dict(), "tokenizer": config.model.tokenizer})
    train_tokens = len(corpus.tokens(quiet=True)[0])  # cached: the data module reads it again
    per_step = (data.loader.batch_size * config.model.context_length
                * (config.trainer.accumulate_grad_batches or 1) * world_size(config.trainer))
    steps = max(1, math.ceil(epochs * train_tokens / per_step))
    if config.trainer.max_steps is not None and 0 <= config.trainer.max_steps <= steps:
        return
    config.trainer.max_steps = steps
    say(f"steps: {steps} (--max_corpus_epochs {epochs:g}: the corpus's {train_tokens:,} "
        f"training tokens, {per_step:,} a step; --trainer.max_steps N trains N)")


def world_size(trainer) -> int:
    """Processes a run's settings train on: nodes x devices ("auto": every GPU, else 1)."""
    devices = trainer.devices
    if isinstance(devices, list | tuple):
        count = len(devices)
    elif isinstance(devices, int) or str(devices).isdigit():
        count = int(devices)
    else:  # "auto" or -1: what Lightning would find
        count = torch.cuda.device_count() if not on_cpu(trainer.accelerator) else 1
    return max(count, 1) * (trainer.num_nodes or 1)


def on_cpu(accelerator) -> bool:
    """Whether Lightning's `accelerator` setting trains on the CPU ("auto" picks a GPU, CUDA
    or Apple's, where there is one)."""
    accelerator = str(accelerator or "auto")
    gpu = torch.cuda.is_available() or torch.backends.mps.is_available()
    return accelerator == "cpu" or (accelerator == "auto" and not gpu)


def plan_source(config, checkpoint: dict, given: Collection[str]) -> Source | None:
    """--model.init_from: the source's architecture (a resumed run's, from its own
    checkpoint: the source may be gone). A model setting given that contradicts it is
    refused, naming both values; the settings not given take the source's."""
    model = config.model
    if model.init_from is None:
        return None
    if not str(model.init_from).strip():
        raise ValueError(f"--model.init_from {model.init_from!r} names no model: give the .ckpt "
                         "or Hugging Face directory to fine-tune, or leave init_from out "
                         "(null) to train from scratch")
    if checkpoint:
        saved = tokenizer_from_dict(tokenizer_entry(checkpoint), "the checkpoint")
        source = Source.resumed(model.init_from, checkpoint, saved.n_vocab)
    else:
        source = Source.read(model.init_from)
        check_source_head(source, config.data.labels)
    cfg = source.config
    contradicting = contradictions(cfg, {f: model[f] for f in given if f in CONFIG_FIELDS})
    if contradicting:
        said = "; ".join(f"--model.{f} {model[f]} (the source has {f}={getattr(cfg, f)!r})"
                         for f in contradicting)
        raise ValueError(
            f"--model.init_from {model.init_from} fixes the architecture, and {said}. "
            "Drop what contradicts it: the architecture comes from the source. A "
            f"fine-tune may change {', '.join(CHANGEABLE_FIELDS[:-1])} and a "
            f"context_length up to {cfg.context_length}")
    for field, value in cfg.to_dict().items():
        if field != "vocab_size" and field not in given:
            model[field] = value
    config.data.windows.max_length = model.context_length  # the link, once more
    return source


def check_source_head(source: Source, labels) -> None:
    """A classifier's head scores its classes, not tokens: only a classification run may
    start from one (its head is replaced), never a language-model fine-tune."""
    if source.classes and not (labels.task or labels.label_field):
        raise ValueError(
            f"--model.init_from {source.path} is a classifier (classes "
            f"{', '.join(source.classes)}): its head scores classes, not tokens, so a "
            "language model cannot be fine-tuned from it; start from the language model it "
            "was tuned from, or fine-tune it as a classifier (--data.labels.label_field or "
            "--data.labels.task)")


def plan_tokenizer(config, checkpoint: dict, source: Source | None, given: Collection[str],
                   run: Path, say: Say) -> tiktoken.Encoding:
    """The run's vocabulary: a resumed run's own (its embeddings are trained for it,
    whatever --model.tokenizer says now), a source's, "bpe:N" fitted to the corpus (cached)
    and saved in the run directory, or the one --model.tokenizer names."""
    asked = str(config.model.tokenizer)
    if checkpoint:
        saved = tokenizer_entry(checkpoint)
        if "tokens" not in saved:  # older checkpoints: a name
            say_overridden_tokenizer(asked, saved["name"], None, checkpoint, say)
            return record_tokenizer(config, get_tokenizer(saved["name"]), run, saved["name"])
        enc = tokenizer_from_dict(saved, where=f"the checkpoint {config.ckpt_path}")
        say_overridden_tokenizer(asked, enc.name, enc.n_vocab, checkpoint, say)
        return record_tokenizer(config, enc, run)
    if source is not None:
        check_source_tokenizer(asked, "tokenizer" in given, source)
        return record_tokenizer(config, source.tokenizer, run,
                                "gpt2" if source.tokenizer.name == "gpt2" else None)
    vocab_size = parse_bpe(asked)
    if vocab_size is None:
        return get_tokenizer(asked)
    fitted = Corpus(**config.data.corpus.as_dict()).fit_tokenizer(vocab_size)
    if config.trainer.fast_dev_run:  # a trial writes nothing in the run folder
        return record_tokenizer(config, load_tokenizer(fitted), run, str(fitted))
    return record_tokenizer(config, load_tokenizer(fitted), run)


def record_tokenizer(config, enc: tiktoken.Encoding, run: Path,
                     name: str | None = None) -> tiktoken.Encoding:
    """Write `enc` into the model and data settings: by `name` when it has one that loads
    it, else saved as the run directory's tokenizer.json (the same file from every rank:
    an atomic rename each). Returns `enc`."""
    if name is None:
        name = str(save_tokenizer(enc, run / "tokenizer.json"))
    config.model.tokenizer = config.data.corpus.tokenizer = name
    return enc


def check_source_tokenizer(asked: str, given: bool, source: Source) -> None:
    """A --model.tokenizer naming another vocabulary than the source's is refused (the
    source's embeddings are trained for its ids)."""
    enc = source.tokenizer
    if given and (parse_bpe(asked) is not None or tokenizer_fingerprint(
            get_tokenizer(asked)) != tokenizer_fingerprint(enc)):
        raise ValueError(
            f"--model.tokenizer {asked} contradicts --model.init_from {source.path}, "
            f"whose embeddings are trained for its own vocabulary ({enc.name}, "
            f"{enc.n_vocab:,} ids): drop --model.tokenizer (the source's is used), or "
            "drop init_from to train from scratch with the new vocabulary")


def say_overridden_tokenizer(asked: str, name: str, n_vocab: int | None, checkpoint: dict,
                             say: Say) -> None:
    """A resume keeps the checkpoint's vocabulary (`name`, `n_vocab` ids; its embeddings
    are trained for those ids); a --model.tokenizer naming another one is said to be
    overridden, as changed learning rates are named. Before, it was replaced silently."""
    used = str(checkpoint.get("hyper_parameters", {}).get("tokenizer", name))
    if asked in (used, name) or (n_vocab is not None and parse_bpe(asked) == n_vocab) or (
            Path(asked).is_file() and Path(asked).resolve() == Path(used).resolve()):
        return
    size = f", {n_vocab:,} ids" if n_vocab else ""
    say(f"resuming: --model.tokenizer {asked} is overridden by the checkpoint's vocabulary "
        f"({name}{size}), which its embeddings are trained for; start a new --run_name to "
        f"train with {asked}")


def plan_classes(config) -> tuple[str, ...] | None:
    """A classification run (--data.labels): the class names, from the training records
    unless given, for the model's head and the data's label ids alike."""
    model, labels = config.model, config.data.labels
    if not (labels.task or labels.label_field):
        if model.classes:
            raise ValueError("--model.classes needs labelled data: set "
                             "--data.labels.label_field (or --data.labels.task)")
        return None
    if model.classes and labels.classes and list(model.classes) != list(labels.classes):
        raise ValueError(f"--model.classes {list(model.classes)} and --data.labels.classes "
                         f"{list(labels.classes)} differ: give the classes once, as "
                         "--data.labels.classes")
    if not labels.classes and model.classes:  # either flag names them
        labels.classes = list(model.classes)
    if not labels.classes:
        data = GPTDataModule(Corpus(**config.data.corpus.as_dict()),
                             labels=Labels(**labels.as_dict()))
        labels.classes = data.class_names()
    model.classes = list(labels.classes)
    return tuple(labels.classes)


def plan_chat(config, tokenizer: tiktoken.Encoding, source: Source | None, run: Path
              ) -> tuple[ChatTemplate | None, tiktoken.Encoding]:
    """--data.chat.records (or --data.preference.records, or --data.rl.task's prompts): the
    template (`gptmini.chat.choose_template`, the one rule for "auto": the source model's
    own first), and the tokenizer with the tokens it adds (the model grows to fit them when
    it loads its source, `gptmini.finetune.grow_vocab`)."""
    found = records_part(config.data)
    if found is None:
        return None, tokenizer
    part, alpaca = found
    own = source.chat_template if source is not None else None
    template = choose_template(part.template, tokenizer, alpaca=alpaca, source=own)
    if part.template == AUTO:  # the config names what was chosen: a built-in, or a file
        built_in = TEMPLATES.get(template.name) == template
        part.template = template.name if built_in else str(
            save_template(template, run / "chat_template.json"))
    grown = add_template_tokens(tokenizer, template)
    if grown is not tokenizer:
        record_tokenizer(config, grown, run)
    return template, grown


def records_part(data) -> tuple[object, bool] | None:
    """(the data settings whose records a template renders, whether "auto" would take the
    book's prompt for them: Alpaca records, the book's pairs), or None. A missing or broken
    file fails here, early."""
    if data.chat.records:
        return data.chat, is_alpaca(read_chat_records(data.chat.records))
    if data.preference.records:
        return data.preference, is_book_layout(read_pairs(data.preference.records))
    if data.rl.task:
        return data.rl, False
    return None


def plan_posttraining(config, say: Say) -> VerifiableTask | None:
    """Preference pairs make a DPO run (--model.dpo), a verifiable task an RL run
    (--model.grpo; its checker is loaded here, so a reward function that cannot be imported
    fails before anything trains); each needs the other half, and DPO its starting weights.

    Returns:
        The RL task's checker, or None.
    """
    model, data = config.model, config.data
    for name, active, flag in (("dpo", data.preference.records, "--data.preference.records"),
                               ("grpo", data.rl.task, "--data.rl.task")):
        if model[name] is not None and not active:
            raise ValueError(f"--model.{name}.* tunes on {flag}: give it, or drop "
                             f"--model.{name}")
        if active and model[name] is None:
            model[name] = Namespace(**asdict(DPO() if name == "dpo" else GRPOSettings()))
    if data.preference.records and not model.init_from:
        raise ValueError("--data.preference.records: DPO tunes a model against its own "
                         "starting weights; name them with --model.init_from (an "
                         "instruction-tuned checkpoint, or any source)")
    if not data.rl.task:
        return None
    verifier = RL(**data.rl.as_dict()).load()
    say(f"rl task: {data.rl.task} ({type(verifier).__name__})")
    return verifier


def save_template(template: ChatTemplate, path: Path) -> Path:
    """Write `template` where `--data.chat.template` can name it (a .json file).

    Raises:
        OSError: the file could not be written (a full disk), naming it.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(template.to_dict()))
    except OSError as err:  # the OS error does not name the file
        raise OSError(err.errno, f"could not write the chat template {path} "
                      f"({err.strerror or err}); free space or fix the disk, then run again"
                      ) from err
    return path
