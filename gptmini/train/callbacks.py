"""Training callbacks: step-boundary checkpoints, stopping on signals, text samples,
attention maps and benchmark scores at each validation (the progress bar:
gptmini.train.progress)."""

import math
import signal
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, ModelSummary
from lightning.pytorch.loggers import WandbLogger

from gptmini.analysis.plots import attention_weights, plot_attention, require_matplotlib
from gptmini.tokenizer import encode_prompt
from gptmini.train.lightning_internals import rewind_batches, save_last_checkpoint
from gptmini.train.module import GPTLitModule
from gptmini.train.rng import rng_states, set_rng_states
from gptmini.train.sharding import is_sharded_run


class EveryNSteps(Callback):
    """The one guard of callbacks that act every `every_n_steps` optimizer steps, on rank 0.

    `due` is true at the batch whose optimizer step just reached a multiple of
    `every_n_steps` (the module's `OptimizerSteps`): once per step, whatever the gradient
    accumulation.
    """

    def __init__(self, every_n_steps: int):
        self.every_n_steps = every_n_steps

    def due(self, trainer: Trainer, pl_module: GPTLitModule, every_rank: bool = False) -> bool:
        """`every_rank`: due on every rank, not rank 0 alone (a sharded model's forward
        needs all of them)."""
        return (
            pl_module.optimizer_steps.stepped(trainer)
            and self.every_n_steps > 0
            and trainer.global_step % self.every_n_steps == 0
            and (trainer.is_global_zero or every_rank)
        )


class StepCheckpoint(ModelCheckpoint):
    """`ModelCheckpoint` that saves only at the batch whose optimizer step just happened.

    Lightning's decides by `global_step` alone, so with gradient accumulation (and after a
    resume, whose first micro-batches share the restored step) it saved in the middle of an
    accumulation: a checkpoint one micro-batch ahead, whose gradient a kill then lost.
    """

    def on_train_batch_end(self, trainer: Trainer, pl_module: GPTLitModule, *args):
        if pl_module.optimizer_steps.stepped(trainer):
            super().on_train_batch_end(trainer, pl_module, *args)
            if run_ends_after(trainer, args[-1]):
                self._save_final(trainer)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule):
        super().on_validation_end(trainer, pl_module)
        if stop_asked(trainer) and not trainer.sanity_checking:  # early stopping decided
            self._save_final(trainer)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule):
        # A stop decided elsewhere (a callback's on_train_epoch_end, say): the epoch is then
        # counted as finished, so a resume starts the next one; still nothing is lost.
        self._save_final(trainer)

    def _save_final(self, trainer: Trainer) -> None:
        """last.ckpt at the step the run ends on. Lightning's saves it only when no
        every_n_train_steps save ever happened: 50 steps with a save every 20 ended with
        last.ckpt at step 40, and steps 41-50 in no file."""
        if self.save_last and trainer.global_step > 0:
            save_last_checkpoint(self, trainer)


class ValidateFinalWeights(Callback):
    """Validate the weights a run ends with, when its last step is not a validation step.

    Lightning validates every val_check_interval batches only: a run of 1,150 steps that
    validated every 200 never scored its last 150 steps, so its report, best.ckpt and page
    all stopped at step 1,000. Asking to stop at the last step makes Lightning validate
    there (as it does for early stopping), once. last.ckpt is saved before it, as at every
    validation step (saved after a validation, Lightning resumes one step behind).
    """

    def on_train_batch_end(self, trainer: Trainer, pl_module: GPTLitModule, outputs, batch,
                           batch_idx: int):
        if pl_module.optimizer_steps.stepped(trainer) and run_ends_after(trainer, batch_idx):
            trainer.should_stop = True


def run_ends_after(trainer: Trainer, batch_idx: int) -> bool:
    """Whether the batch that just ended is the run's last: max_steps reached, the last
    batch of the last epoch, or a stop already asked for (--trainer.max_time's timer)."""
    last_epoch = trainer.max_epochs is not None and trainer.max_epochs >= 0 and (
        trainer.current_epoch + 1 >= trainer.max_epochs)
    return (
        stop_asked(trainer)
        or 0 <= trainer.max_steps <= trainer.global_step
        or (last_epoch and batch_idx + 1 >= trainer.num_training_batches)
    )


def stop_asked(trainer: Trainer) -> bool:
    """trainer.should_stop, unless min_steps or min_epochs keep the run going."""
    return trainer.should_stop and trainer.global_step >= (trainer.min_steps or 0) and (
        trainer.current_epoch >= (trainer.min_epochs or 0))


class ModelSummaryWithoutFlops(ModelSummary):
    """Lightning's model summary, without its FLOPs column and "Total FLOPs: 0" line.

    Lightning counts FLOPs only for a module with an example input, which ours has not, so
    every run printed zeros (the MFU line at the start says the FLOPs per token). Plain
    text, whether or not `rich` is installed, as a log file keeps it.
    """

    @staticmethod
    def summarize(summary_data: list[tuple[str, list[str]]], total_parameters: int,
                  trainable_parameters: int, model_size: float,
                  total_training_modes: dict[str, int], total_flops: int,
                  **summarize_kwargs: Any) -> None:
        columns = [(name, values) for name, values in summary_data if name != "FLOPs"]
        widths = [max(len(name), *(len(str(v)) for v in values)) for name, values in columns]
        lines = [" | ".join(name.ljust(w) for (name, _), w in zip(columns, widths, strict=True))]
        lines.append("-" * len(lines[0]))
        lines += [" | ".join(str(v).ljust(w) for v, w in zip(row, widths, strict=True))
                  for row in zip(*(values for _, values in columns), strict=True)]
        lines.append(f"{total_parameters:,} parameters ({trainable_parameters:,} trainable), "
                     f"{model_size:,.1f} MB of weights; {total_training_modes['train']} "
                     f"modules in train mode, {total_training_modes['eval']} in eval mode")
        print("\n".join(lines), flush=True)


class RunInterrupted(Exception):
    """Training stopped on a signal, after saving a resumable checkpoint."""

    def __init__(self, signum: int, step: int, path: Path):
        self.signum, self.step, self.path = signum, step, path
        name = signal.Signals(signum).name
        super().__init__(
            f"stopped by {name} at step {step}; saved {path}. Resume with --ckpt_path last"
        )

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # what a shell reports for a process the signal ended


class StoppedAtOnce(BaseException):
    """A second signal stopped training at once, without saving: the last checkpoint stays.

    A BaseException (like KeyboardInterrupt, which Lightning turns into exit code 1): it
    must get through `except Exception` on its way out, even out of a checkpoint write.
    """

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"stopped at once by a second {signal.Signals(signum).name}, without "
                         "saving; the last checkpoint stays. Resume with --ckpt_path last")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def hand_on(signum: int, handler: Any) -> None:
    """Do with `signum` what `handler` (the caller's, from before training) does, once a run
    it stopped has saved and unwound: training inside another program (pytest, a notebook)
    must not swallow that program's Ctrl-C or SIGTERM. A Python handler is called (Python's
    own for SIGINT raises KeyboardInterrupt); the default action is restored and the signal
    sent again (SIGTERM ends the process, as it would have); an ignored signal stays so."""
    if callable(handler):
        handler(signum, None)
    elif handler == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)


class StopOnSignal(Callback):
    """On SIGTERM or SIGINT (Ctrl-C), stop at an optimizer step with a resumable checkpoint.

    `kill`, `docker stop` and schedulers' preemptions send SIGTERM. The step in progress
    (the rest of an accumulation) is finished if it ends within `grace_seconds` of the
    signal; otherwise the run keeps the last completed step, rolling the data position and
    the random state back so the partial accumulation is replayed on resume. The checkpoint
    is written atomically to `path`, then `RunInterrupted` ends the run (train.py exits with
    128 + the signal's number). Under DDP all ranks stop at the same step: they combine
    their flags after every batch (one small all-reduce; Lightning's own SIGTERM handling
    also broadcasts one per batch). A second signal stops at once, without saving: the
    last checkpoint stays.

    Lightning's SIGTERM handling stops at the next micro-batch, without a checkpoint and
    with exit code 0, and Ctrl-C saves nothing; this replaces both while training runs.
    What the signal does after the save is the caller's (`gptmini.train.command.fit`):
    train.py exits with the code; a program that trains inside itself gets its signal back
    (`hand_on`).
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, path: str | Path, grace_seconds: float = 20.0):
        self.path = Path(path)
        self.grace_seconds = grace_seconds
        self._signum = 0
        self._deadline = math.inf
        self._previous: dict[int, Any] = {}
        self._rng_at_step: dict | None = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule):
        self._signum, self._deadline = 0, math.inf
        self._snapshot_rng(trainer)
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._on_signal) for s in self.SIGNALS}

    def _on_signal(self, signum: int, frame) -> None:
        if self._signum:  # asked twice: stop now
            self._restore_handlers()
            raise StoppedAtOnce(signum)
        self._signum, self._deadline = signum, time.monotonic() + self.grace_seconds
        print(f"\nreceived {signal.Signals(signum).name}: finishing the optimizer step in "
              "progress, then saving a checkpoint (signal again to stop at once)", flush=True)

    def on_train_batch_end(self, trainer: Trainer, pl_module: GPTLitModule, *args):
        stepped = pl_module.optimizer_steps.stepped(trainer)
        if stepped:
            self._snapshot_rng(trainer)
        signum, expired = self._agree(trainer, pl_module)
        if not signum or not (stepped or expired):
            return  # no signal, or the step in progress can still finish in time
        if not stepped:  # out of time mid-accumulation: back to the last completed step
            self._roll_back(trainer, pl_module.optimizer_steps.since_step(trainer))
        trainer.save_checkpoint(self.path, weights_only=False)  # None logs that it was unset
        raise RunInterrupted(signum, trainer.global_step, self.path)

    def _agree(self, trainer: Trainer, pl_module: LightningModule) -> tuple[int, bool]:
        flags = [self._signum, int(time.monotonic() > self._deadline)]
        if trainer.world_size > 1 and torch.distributed.is_initialized():
            tensor = torch.tensor(flags, device=pl_module.device)
            torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
            flags = tensor.tolist()
        return int(flags[0]), bool(flags[1])

    def _snapshot_rng(self, trainer: Trainer) -> None:
        if trainer.accumulate_grad_batches > 1:  # only a partial accumulation is rolled back
            self._rng_at_step = rng_states()

    def _roll_back(self, trainer: Trainer, micro_batches: int) -> None:
        # The loop, the data position and the random state as at the last step's batch end.
        rewind_batches(trainer, micro_batches)
        rewind = getattr(trainer.datamodule, "rewind", None)
        if rewind is not None:
            rewind(micro_batches)
        if self._rng_at_step is not None:
            set_rng_states(self._rng_at_step)

    def _restore_handlers(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule):
        self._restore_handlers()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception):
        self._restore_handlers()


SHAKESPEARE_PROMPT = "ROMEO:"
"""The samples' prompt on the embedded corpus; other corpora get their own words."""


def corpus_prompt(trainer: Trainer, num_tokens: int, shakespeare: str) -> str:
    """The run's corpus's own prompt (`GPTDataModule.sample_prompt`); `shakespeare` with a
    data module that has none."""
    datamodule = getattr(trainer, "datamodule", None)
    if datamodule is None or not hasattr(datamodule, "sample_prompt"):
        return shakespeare
    return datamodule.sample_prompt(num_tokens, shakespeare)


class SampleCallback(EveryNSteps):
    """Every `every_n_steps`, continue a fixed prompt and log the text.

    Printed to the console, and added to a wandb table when wandb logs the run. Sampling
    runs under a forked random generator, so it never changes the training run's dropout.
    The prompt: `prompt`, or with None the start of a validation document of the corpus
    ("ROMEO:" on the embedded Shakespeare).
    """

    def __init__(self, every_n_steps: int = 200, prompt: str | None = None,
                 max_new_tokens: int = 40):
        super().__init__(every_n_steps)
        self.asked, self.prompt = prompt, prompt or SHAKESPEARE_PROMPT
        self.max_new_tokens = max_new_tokens

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule):
        if self.asked is None and self.every_n_steps > 0:
            self.prompt = corpus_prompt(trainer, 8, SHAKESPEARE_PROMPT)

    def on_train_batch_end(self, trainer: Trainer, pl_module: GPTLitModule, *args):
        # A sharded model's every forward gathers from all ranks: they all sample alike.
        if not self.due(trainer, pl_module, every_rank=is_sharded_run(pl_module.model)):
            return
        step = trainer.global_step
        text = sample_text(pl_module, self.prompt, self.max_new_tokens)
        if not trainer.is_global_zero:
            return
        print(f"\n[step {step}] {text!r}", flush=True)
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.log_text(key="samples", columns=["step", "text"], data=[[step, text]])


def sample_text(pl_module: GPTLitModule, prompt: str, max_new_tokens: int, seed: int = 0) -> str:
    from gptmini.generate.loop import generate

    tokenizer = pl_module.tokenizer
    model = pl_module.model
    ids = encode_prompt(tokenizer, prompt)
    idx = torch.tensor([ids], device=pl_module.device)
    was_training = model.training
    model.eval()
    devices = [pl_module.device] if pl_module.device.type == "cuda" else []
    # A compiled model would recompile for every new length; sampling runs it eagerly.
    with torch.random.fork_rng(devices=devices), torch.compiler.set_stance("force_eager"):
        torch.manual_seed(seed)
        out = generate(model, idx, max_new_tokens, model.cfg.context_length,
                       temperature=0.8, top_k=50)
    model.train(was_training)
    return tokenizer.decode(out[0].tolist())


class TaskScores(Callback):
    """At each validation, score the model on standard benchmarks (gptmini.analysis.tasks):
    the same `limit` items of each task every time, logged as `val/<task>` (its primary
    metric) and `val/tasks` (their centred mean), as OLMo's and nanochat's in-loop
    evaluations. The items are read when the run starts, so missing task files stop it
    before its first step."""

    def __init__(self, tasks: list[str], limit: int, task_data: str | None = None):
        from gptmini.analysis.tasks import find_task_files, read_task

        source = find_task_files(task_data)
        self.tasks = [read_task(source, spec, limit) for spec in tasks]
        self.benchmarks = [task.name for task in self.tasks]  # the report's line

    def setup(self, trainer: Trainer, pl_module: GPTLitModule, stage: str):
        if not pl_module.task.generates_text:
            raise ValueError("--eval_tasks scores a language model's next tokens; this run "
                             "trains a classifier (its head scores classes): drop --eval_tasks")

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: GPTLitModule):
        from gptmini.analysis.tasks import aggregate, score_task

        if trainer.sanity_checking:
            return
        # Every rank scores the same items (a sharded model's forward gathers from all):
        # the numbers agree, and each rank logs them.
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            scores = [score_task(pl_module.model, pl_module.tokenizer, task, progress=False)
                      for task in self.tasks]
        for score in scores:  # (alike on every rank: the mean over them is each one's)
            pl_module.log(f"val/{score.task.name}", score.primary, sync_dist=True)
        pl_module.log("val/tasks", aggregate(scores), sync_dist=True)


class AttentionMapCallback(EveryNSteps):
    """Every `every_n_steps` optimizer steps, draw all heads of one layer on a fixed prompt.

    The PNG goes to `<log_dir>/attention/step_N.png` (the CSV logger's version folder, or
    the trainer's default_root_dir), and to wandb as the image "attention" when a
    `WandbLogger` is attached. Runs on global rank zero only, in eval mode without
    gradients and under a forked random generator, so the training run is the same with
    and without it. When the maps cannot be drawn (no matplotlib, a prompt longer than the
    model's context, a layer out of range) it warns once and training goes on without them.

    Args:
        every_n_steps: optimizer steps between maps; 0 or less turns the callback off.
        prompt: the text whose attention is drawn; None: the start of a validation
            document of the corpus (a line of Romeo and Juliet on the embedded Shakespeare).
        layer: the transformer block, negative counting from the last.
    """

    SHAKESPEARE = "ROMEO: But soft, what light"

    def __init__(
        self,
        every_n_steps: int = 500,
        prompt: str | None = None,
        layer: int = -1,
    ):
        super().__init__(every_n_steps)
        self.asked, self.prompt = prompt, prompt or self.SHAKESPEARE
        self.layer = layer
        self._disabled = every_n_steps <= 0

    def _disable(self, reason: str):
        warnings.warn(f"AttentionMapCallback: {reason}; no attention maps", stacklevel=2)
        self._disabled = True

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule):
        if self._disabled or not trainer.is_global_zero:
            return
        if is_sharded_run(pl_module.model):
            return self._disable("a sharded model (--trainer.strategy fsdp2) has its weights "
                                 "on every rank, and the maps are drawn on one; draw them "
                                 "from a checkpoint with visualize.py")
        if self.asked is None:
            self.prompt = corpus_prompt(trainer, 12, self.SHAKESPEARE)
        try:
            require_matplotlib()
        except ImportError as err:
            return self._disable(str(err))
        cfg = pl_module.model.cfg
        num_tokens = len(encode_prompt(pl_module.tokenizer, self.prompt))
        if num_tokens > cfg.context_length:
            return self._disable(
                f"the prompt is {num_tokens} tokens, longer than context_length "
                f"{cfg.context_length}"
            )
        if not -cfg.n_layers <= self.layer < cfg.n_layers:
            return self._disable(f"layer {self.layer} is out of range for {cfg.n_layers} layers")
        without = [m.title for m in pl_module.model.mixers if not m.has_weights]
        if without:
            return self._disable(f"layer_kinds {cfg.layer_kinds} has {without[0]} layers, "
                                 "which have no attention weights")

    def on_train_batch_end(self, trainer: Trainer, pl_module: GPTLitModule, *args):
        if self._disabled or not self.due(trainer, pl_module):
            return
        step = trainer.global_step
        path = self.draw(trainer, pl_module, step)
        from lightning.pytorch.loggers import WandbLogger

        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.log_image(key="attention", images=[str(path)], step=step)

    def draw(self, trainer: Trainer, pl_module: LightningModule, step: int) -> Path:
        """Compute and write the map of `step`; returns the PNG's path."""
        tokenizer = pl_module.tokenizer
        model = pl_module.model
        layer = self.layer % model.cfg.n_layers
        devices = [pl_module.device] if pl_module.device.type == "cuda" else []
        # Eager even when the model is compiled: no recompiling for the prompt's length.
        with torch.random.fork_rng(devices=devices), torch.compiler.set_stance("force_eager"):
            weights, labels = attention_weights(model, tokenizer, self.prompt, layer)
        out = Path(trainer.log_dir or trainer.default_root_dir) / "attention" / f"step_{step}.png"
        return plot_attention(
            weights, labels, out, layer=layer, title=f"Step {step}: attention of layer {layer}"
        )
