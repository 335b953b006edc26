"""The training command: LightningCLI over `GPTLitModule` and `GPTDataModule`, with the
run directory, loggers, checkpoints and sample callback a training run needs.

A run lives in `<trainer.default_root_dir>/<run_name>/`:
    checkpoints/last.ckpt   every --checkpoint_every steps (resume with --ckpt_path last)
    checkpoints/best.ckpt   lowest val/loss so far
    logs/version_N/         metrics.csv and hparams.yaml of each invocation (CSV logger)
    wandb/                  when --wandb true
"""

import ctypes
import ctypes.util
import difflib
import logging
import os
import signal
import sys
import warnings
from pathlib import Path

import torch
from jsonargparse import set_parsing_settings
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException

from gptmini.checkpoint import check_readable, read_checkpoint, tokenizer_entry
from gptmini.checkpoint.atomic import AtomicCheckpointIO, remove_stale_temporaries
from gptmini.data import Corpus, GPTDataModule
from gptmini.data.vocab import parse_bpe
from gptmini.runtime import AUTO, auto_precision
from gptmini.tokenizer import load_tokenizer, save_tokenizer, tokenizer_from_dict
from gptmini.train.callbacks import (
    AttentionMapCallback,
    ModelSummaryWithoutFlops,
    RunInterrupted,
    SampleCallback,
    StepCheckpoint,
    StopOnSignal,
    StoppedAtOnce,
    ValidateFinalWeights,
)
from gptmini.train.lightning_internals import option_strings
from gptmini.train.loggers import make_loggers
from gptmini.train.module import GPTLitModule
from gptmini.train.progress import progress_bar
from gptmini.train.report import RunReport
from gptmini.train.run_lock import is_first_process, run_lock

DEFAULT_CONFIG = Path(__file__).parents[1] / "configs" / "shakespeare-cpu.yaml"
"""The default run: `python train.py` trains it, and every other config applies on top."""
SUMMARY_NOTICE = "Trainer already configured with model summary callbacks"
"""What Lightning says when a run brings its own model summary, as every train.py run does."""
HELP_DESCRIPTION = (
    "Train a GPT. With no option it trains the default run (gptmini/configs/"
    "shakespeare-cpu.yaml) into runs/shakespeare-cpu/; every option below is applied on top "
    "of it and may also be written in a YAML file given with --config. Your own corpus: "
    "--data.corpus.source FILE (the run is then named after it). The optimizer and its "
    "schedule are --model.optimizer and the --model.* rates below.")
# How gptmini drives Lightning, whatever the run; a run's own choices are in its config.
TRAINER_DEFAULTS = {
    "check_val_every_n_epoch": None,  # validate every val_check_interval steps, across epochs
    "log_every_n_steps": 10,
    "use_distributed_sampler": False,  # GPTDataModule shards windows across ranks itself
    "default_root_dir": "runs",
}


class GPTTrainer(Trainer):
    """Lightning's Trainer, whose precision may also be "auto" (the default): bf16-mixed
    where the device computes bf16 natively, 32-true elsewhere (see gptmini.runtime)."""

    def __init__(self, *, precision: str | int | None = AUTO, **kwargs):
        """Lightning's Trainer arguments.

        Args:
            precision: "auto" (bf16-mixed where the CPU or GPU has bf16 units, else
                32-true; a resumed run keeps its checkpoint's), or any of Lightning's:
                32-true, bf16-mixed, bf16-true, 16-mixed, 16-true, 64-true.
        """
        if precision == AUTO:
            precision, _ = auto_precision(kwargs.get("accelerator"))
        super().__init__(precision=precision, **kwargs)


class GPTCLI(LightningCLI):
    def add_arguments_to_parser(self, parser):
        parser.add_argument("--run_name", type=str, default="run",
                            help="Folder of this run under trainer.default_root_dir; a run "
                                 "given --data.corpus.source without it is named after "
                                 "that corpus.")
        parser.add_argument("--ckpt_path", type=str | None, default=None,
                            help="Resume: 'last' (this run's last.ckpt) or a checkpoint path.")
        parser.add_argument("--checkpoint_every", type=int, default=100,
                            help="Save checkpoints/last.ckpt every this many optimizer steps.")
        parser.add_argument("--sample_every", type=int, default=200,
                            help="Log a sample of generated text every this many steps (0: off).")
        parser.add_argument("--sample_prompt", type=str | None, default=None,
                            help="Prompt of the samples (and of the attention maps and the "
                                 "report's generate command); default: the start of a "
                                 "validation document, 'ROMEO:' on the embedded corpus.")
        parser.add_argument("--attention_every", type=int, default=0,
                            help="Save the attention map of a fixed prompt every this many "
                                 "steps (0: off; needs matplotlib).")
        parser.add_argument("--wandb", type=bool, default=False,
                            help="Also log to Weights & Biases (offline when no API key).")
        parser.add_argument("--wandb_project", type=str, default="gptmini")
        parser.add_argument("--stop_grace", type=float, default=20.0,
                            help="On SIGTERM or Ctrl-C, seconds allowed to finish the optimizer "
                                 "step in progress before falling back to the last one.")
        # One window length for model and data, one tokenizer for both.
        parser.link_arguments("model.context_length", "data.windows.max_length")
        parser.link_arguments("model.tokenizer", "data.corpus.tokenizer")

    def instantiate_trainer(self, **kwargs) -> Trainer:
        cfg = self.config
        checkpoints = run_dir(self) / "checkpoints"
        if cfg.trainer.logger in (None, True):
            kwargs["logger"] = make_loggers(run_dir(self), cfg.run_name, cfg.wandb,
                                            cfg.wandb_project)
        self.trainer_defaults["callbacks"] = [
            StepCheckpoint(dirpath=checkpoints, save_top_k=0, save_last=True,
                           every_n_train_steps=cfg.checkpoint_every,
                           enable_version_counter=False),
            StepCheckpoint(dirpath=checkpoints, filename="best", monitor="val/loss",
                           mode="min", save_top_k=1, enable_version_counter=False),
            StopOnSignal(checkpoints / "last.ckpt", grace_seconds=cfg.stop_grace),
            ValidateFinalWeights(),  # the report, best.ckpt and the page end at the last step
            SampleCallback(cfg.sample_every, cfg.sample_prompt),
            RunReport(run_dir(self), cfg.sample_prompt),  # printed when the run ends
        ]
        if cfg.trainer.enable_progress_bar is not False:
            # Refreshing reads the logged values off the device: only when they are logged.
            every = max(1, cfg.trainer.log_every_n_steps) * max(
                1, cfg.trainer.accumulate_grad_batches)
            self.trainer_defaults["callbacks"].append(progress_bar(refresh_rate=every))
        if cfg.trainer.enable_model_summary is not False:
            self.trainer_defaults["callbacks"].append(ModelSummaryWithoutFlops())
        if cfg.attention_every > 0:
            maps = AttentionMapCallback(cfg.attention_every, cfg.sample_prompt)
            self.trainer_defaults["callbacks"].append(maps)
        # Checkpoints are written beside their target and renamed (see checkpoint_io).
        plugins = _as_list(self.config_init.get("trainer.plugins"))
        kwargs["plugins"] = [AtomicCheckpointIO(), *plugins]
        return super().instantiate_trainer(**kwargs)

    def before_instantiate_classes(self) -> None:
        check_intervals(self.config)
        self._name_after_corpus()
        resumed = _saved(self.config.ckpt_path, run_dir(self))  # read once, for both
        self._resolve_precision(resumed)
        self._resolve_tokenizer(resumed)
        accelerator = str(self.config.trainer.accelerator)
        if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else "no GPU visible"
            raise ValueError(
                f"--trainer.accelerator {accelerator}: this machine has no CUDA GPU (torch "
                f"{torch.__version__}, {build}); use --trainer.accelerator cpu or auto"
            )

    def _name_after_corpus(self) -> None:
        """A run given another corpus on the command line (--data.corpus.source) and no
        --run_name is named after that corpus ("notes" for notes.txt): before, it kept its
        config's name (shakespeare-cpu), whose checkpoints then refused it."""
        given = [a.split("=", 1)[0] for a in getattr(self, "_command_line", [])]
        if "--run_name" in given or "--data.corpus.source" not in given:
            return
        name = corpus_name(self.config)
        if name is None:
            return  # the embedded corpus keeps the config's name; a bad one errors later
        self.config.run_name = name
        if rank_zero_only.rank == 0:
            print(f"run name: {name} (after the corpus; --run_name names it otherwise)",
                  flush=True)

    def _resolve_precision(self, checkpoint: dict) -> None:
        """--trainer.precision auto, decided here and said: a resumed run keeps the precision
        its checkpoint was trained in, on whatever machine it resumes."""
        trainer = self.config.trainer
        if trainer.precision != AUTO:
            return
        saved = checkpoint.get("precision")
        if saved is not None:
            trainer.precision, why = saved, "kept from the checkpoint being resumed"
        else:
            trainer.precision, why = auto_precision(trainer.accelerator)
        if rank_zero_only.rank == 0:
            print(f"precision: {trainer.precision} (auto: {why})", flush=True)

    def _resolve_tokenizer(self, checkpoint: dict) -> None:
        """--model.tokenizer bpe:N: the vocabulary fitted to this run's corpus (cached), saved
        as the run directory's tokenizer.json; model and data then read that file. A resumed
        run takes the vocabulary its checkpoint holds, whatever the corpus says now."""
        model, data = self.config.model, self.config.data
        if model.init_from and model.tokenizer != "gpt2":
            raise ValueError(
                f"--model.init_from {model.init_from} starts from GPT-2's weights, whose "
                f"embeddings only fit GPT-2's vocabulary, not --model.tokenizer "
                f"{model.tokenizer}: fine-tune with the gpt2 tokenizer, or drop init_from to "
                "train from scratch with the new vocabulary"
            )
        if checkpoint:  # resuming: the vocabulary cannot change (older checkpoints: a name)
            saved = tokenizer_entry(checkpoint)
            if "tokens" not in saved:
                say_overridden_tokenizer(model.tokenizer, saved["name"], None, checkpoint)
                model.tokenizer = data.corpus.tokenizer = saved["name"]
                return
            enc = tokenizer_from_dict(saved, where=f"the checkpoint {self.config.ckpt_path}")
            say_overridden_tokenizer(model.tokenizer, enc.name, enc.n_vocab, checkpoint)
        else:
            vocab_size = parse_bpe(model.tokenizer)
            if vocab_size is None:
                return
            fitted = Corpus(**data.corpus.as_dict()).fit_tokenizer(vocab_size)
            if self.config.trainer.fast_dev_run:  # a trial writes nothing in the run folder
                model.tokenizer = data.corpus.tokenizer = str(fitted)
                return
            enc = load_tokenizer(fitted)
        target = run_dir(self) / "tokenizer.json"
        save_tokenizer(enc, target)  # the same file from every rank: an atomic rename each
        model.tokenizer = data.corpus.tokenizer = str(target)

    def parse_arguments(self, parser, args):
        self._command_line = list(sys.argv[1:] if args is None else args)
        check_keys(parser, self._command_line)
        super().parse_arguments(parser, args)


def say_overridden_tokenizer(asked: str, name: str, n_vocab: int | None,
                             checkpoint: dict) -> None:
    """A resume keeps the checkpoint's vocabulary (`name`, `n_vocab` ids; its embeddings
    are trained for those ids); a --model.tokenizer naming another one is said to be
    overridden, as changed learning rates are named. Before, it was replaced silently."""
    used = str(checkpoint.get("hyper_parameters", {}).get("tokenizer", name))
    if asked in (used, name) or (n_vocab is not None and parse_bpe(asked) == n_vocab) or (
            Path(asked).is_file() and Path(asked).resolve() == Path(used).resolve()):
        return
    if rank_zero_only.rank == 0:
        size = f", {n_vocab:,} ids" if n_vocab else ""
        print(f"resuming: --model.tokenizer {asked} is overridden by the checkpoint's "
              f"vocabulary ({name}{size}), which its embeddings are trained for; start a new "
              f"--run_name to train with {asked}", flush=True)


def _saved(ckpt_path: str | None, run: Path) -> dict:
    """The checkpoint to resume, memory-mapped ({}: none, or unreadable; fit() reports an
    unreadable one)."""
    if ckpt_path is None:
        return {}
    path = run / "checkpoints" / "last.ckpt" if ckpt_path == "last" else Path(ckpt_path)
    try:
        return read_checkpoint(path, "cpu", mmap=True)
    except (ValueError, FileNotFoundError):
        return {}


def check_keys(parser, args: list[str]):
    """Unknown `--a.b` options: name the key and suggest the closest known one."""
    known = option_strings(parser)
    for arg in args:
        key = arg.split("=", 1)[0]
        if not key.startswith("--") or key in known or key in ("--help", "-h"):
            continue
        if key.startswith("--trainer.") and key.count(".") > 1:
            continue  # nested class arguments (callbacks, plugins) are checked by jsonargparse
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else "; see --help for the options"
        raise SystemExit(f"train.py: unknown option {key}{hint}")


def keep_freed_memory() -> bool:
    """Let glibc keep freed memory for reuse instead of handing it back to the kernel.

    A training step allocates and frees tensors of hundreds of MB (the logits over the
    vocabulary). glibc serves each from fresh mmap pages that the kernel must fault in and
    zero, every step. Served from the heap and kept there, the default model trains 1.40x
    faster (measured 2026-11-23 on a 2-core Intel Xeon with AMX, fp32, plain loop: 1,858 vs
    1,328 tok/s, medians of 3 alternating runs; 1.35x on an AMD EPYC before). It is a
    process-wide setting, so only the train.py entry point and the benchmark call it, not
    the library. Linux with glibc only; elsewhere this does nothing and returns False.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        m_trim_threshold, m_mmap_max = -1, -4
        return bool(libc.mallopt(m_mmap_max, 0) and libc.mallopt(m_trim_threshold, 2**31 - 1))
    except (OSError, AttributeError):  # musl or another libc without mallopt
        return False


def _not_an_advert(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(("💡 Tip:", SUMMARY_NOTICE))


def quiet_lightning() -> None:
    """Silence what Lightning prints that is no user's to act on: start-up adverts for its
    cloud products (litlogger, litmodels), a deprecation warning its own code raises under
    torch 2.13 (`isinstance(treespec, LeafSpec)`, at every resume), "checkpoint directory
    exists and is not empty" (a resume writes there by design; `fit` refuses a new run over
    another's checkpoints), the model summary's "Precision bf16-mixed is not supported"
    (mixed precision keeps float32 weights: the 32 bits it falls back to are right), and
    the notice that ours replaces Lightning's (see ModelSummaryWithoutFlops). Narrow
    filters: every other message stays."""
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if _not_an_advert not in logger.filters:
            logger.addFilter(_not_an_advert)
    warnings.filterwarnings("ignore", message=r"Precision \S+-mixed is not supported by the "
                                              r"model summary")
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")


def build_cli(args: list[str] | None = None) -> GPTCLI:
    """Parse the command line (or `args`) and build model, data and trainer."""
    quiet_lightning()
    set_parsing_settings(docstring_parse_attribute_docstrings=True)  # GPTConfig's field docs
    return GPTCLI(
        GPTLitModule,
        GPTDataModule,
        trainer_class=GPTTrainer,
        args=args,
        run=False,
        # No --optimizer/--lr_scheduler of Lightning's: they replaced --model.optimizer and
        # the warmup-cosine schedule silently (only a warning said configure_optimizers
        # "will be overridden"); the module's own settings are the one way to choose.
        auto_configure_optimizers=False,
        seed_everything_default=1234,
        trainer_defaults=dict(TRAINER_DEFAULTS),
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"default_env": False, "default_config_files": [str(DEFAULT_CONFIG)],
                       # one usage line, not argparse's 90 lines repeating every option
                       "usage": "train.py [--config FILE] [--<section>.<option> VALUE ...]",
                       "description": HELP_DESCRIPTION},
    )


def fit(cli: GPTCLI):
    """Train, resuming from --ckpt_path when given; refuse to write over another run.

    Raises:
        RunInterrupted: a signal stopped the run after saving a resumable checkpoint.
        RunInUse: another live train.py holds the run directory (see gptmini.train.run_lock).
    """
    with run_lock(run_dir(cli), enabled=is_first_process()):
        _fit(cli)


def _fit(cli: GPTCLI):
    ckpt, checkpoints = cli.config.ckpt_path, run_dir(cli) / "checkpoints"
    if ckpt == "last" and not (checkpoints / "last.ckpt").is_file():
        print(f"no last.ckpt for run {cli.config.run_name!r} yet; starting from scratch")
        ckpt = None
    elif ckpt is not None and ckpt != "last" and not Path(ckpt).is_file():
        raise FileNotFoundError(f"--ckpt_path {ckpt} does not exist; use 'last' or a .ckpt file")
    if ckpt is not None:
        check_readable(checkpoints / "last.ckpt" if ckpt == "last" else ckpt)
    existing = sorted(p.name for p in checkpoints.glob("*.ckpt")) if checkpoints.is_dir() else []
    if ckpt is None and existing and not cli.trainer.fast_dev_run:  # a trial saves nothing
        raise ValueError(already_trained(cli.config, checkpoints, existing))
    check_accumulation(cli.trainer)
    if checkpoints.is_dir():
        remove_stale_temporaries(checkpoints)  # of saves a kill interrupted
    cli.model.resuming = ckpt is not None  # decided before setup: init_from is not read
    cli.trainer.fit(cli.model, cli.datamodule, ckpt_path=ckpt)


def corpus_name(config) -> str | None:
    """The short name of the run's corpus ("notes" for notes.txt, "fineweb-edu" for a hub
    dataset); None for the embedded corpus, or one that does not resolve (the data module
    then says what is wrong with it)."""
    if config.data.corpus.source is None:
        return None
    try:
        return Corpus(**config.data.corpus.as_dict()).resolve().name
    except (ValueError, OSError):
        return None


def already_trained(config, checkpoints: Path, existing: list[str]) -> str:
    """Why a new run may not start where checkpoints are, with the fix that fits: the same
    corpus is resumed; another corpus gets a name of its own."""
    head = (f"run {config.run_name!r} already has checkpoints in {checkpoints} "
            f"({', '.join(existing)}), which a new run would overwrite")
    try:
        saved = read_checkpoint(checkpoints / ("last.ckpt" if "last.ckpt" in existing
                                               else existing[0]), "cpu", mmap=True)
        trained_on = saved["datamodule_hyper_parameters"]["source"]
    except (ValueError, OSError, KeyError, TypeError):
        trained_on = ...  # unreadable or older: no corpus to compare
    source = config.data.corpus.source
    if trained_on is ... or trained_on == source:
        same = "" if trained_on is ... else "; it trained on this corpus"
        return (f"{head}{same}. Resume it with --ckpt_path last, or start fresh under "
                "another --run_name")
    name = corpus_name(config) or "shakespeare"
    if name == config.run_name:
        name += "-2"

    def corpus(text: str | None) -> str:
        return "the embedded Shakespeare corpus" if text is None else text

    return (f"{head}; it trained on {corpus(trained_on)}, and this run is on "
            f"{corpus(source)}: give this run a name of its own, e.g. --run_name {name}")


def check_intervals(config) -> None:
    """gptmini's own step counts: one clear line instead of a failure deep in a callback."""
    for name, low in (("checkpoint_every", 1), ("sample_every", 0), ("attention_every", 0),
                      ("stop_grace", 0)):
        value = config[name]
        if value < low:
            raise ValueError(f"--{name}={value} is invalid: use {low} or more"
                             + (" (0 turns it off)" if low == 0 and name != "stop_grace" else ""))


def check_accumulation(trainer: Trainer) -> None:
    """Validation (and best.ckpt with it) must fall between optimizer steps.

    Lightning counts val_check_interval in batches; with gradient accumulation a count that
    is not a multiple of accumulate_grad_batches would validate, and save, mid-step.
    """
    every, accumulate = trainer.val_check_interval, trainer.accumulate_grad_batches
    if isinstance(every, int) and accumulate > 1 and every % accumulate:
        fit_to = max(accumulate, every // accumulate * accumulate)
        raise ValueError(
            f"trainer.val_check_interval={every} batches is not a multiple of "
            f"accumulate_grad_batches={accumulate}, so validation would fall inside an "
            f"optimizer step; use a multiple, e.g. --trainer.val_check_interval {fit_to}"
        )


def main(args: list[str] | None = None) -> int:
    """Run training from the command line (or from `args`); returns the exit code.

    Errors a user can fix print one line instead of a traceback; set GPTMINI_TRACEBACK=1
    to see the traceback anyway. A run stopped by a signal returns 128 + its number.
    """
    try:
        fit(build_cli(args))
    except (RunInterrupted, StoppedAtOnce) as stop:
        print(f"train.py: {stop}", file=sys.stderr)
        return stop.exit_code
    except SIGTERMException:  # before training began (Lightning's handler): nothing to save
        print("train.py: stopped by SIGTERM before training began", file=sys.stderr)
        return 128 + signal.SIGTERM
    except (FloatingPointError, ValueError, OSError, MisconfigurationException) as err:
        if os.environ.get("GPTMINI_TRACEBACK"):
            raise
        verb = "stopped" if isinstance(err, FloatingPointError) else "error"
        print(f"train.py: {verb}: {err}", file=sys.stderr)
        return 1
    return 0


def _as_list(value) -> list:
    return [] if value is None else list(value) if isinstance(value, list | tuple) else [value]


def run_dir(cli: GPTCLI) -> Path:
    return Path(cli.config.trainer.default_root_dir or "runs") / cli.config.run_name
