"""The LightningModule that trains `GPTModel`: one step for every task, AdamW or Muon,
warmup + cosine, non-finite steps skipped, exact resume.

What a run learns is its `Task` (`gptmini.train.tasks`: the loss, the metrics, what a batch
holds); which weights train is its `AllWeights` or `LoRA` (`gptmini.train.adapters`); the
module asks them and branches on neither."""

import warnings
from dataclasses import asdict, is_dataclass, replace
from functools import partial

import lightning as L
import tiktoken
import torch
from torch import Tensor

from gptmini.chat import ChatTemplate
from gptmini.checkpoint import model_config, write_model_entries
from gptmini.data.verifiable import VerifiableTask
from gptmini.finetune import adapter_state
from gptmini.finetune.dpo import DPO
from gptmini.model import ConfigError, GPTConfig, GPTModel, init_gpt2_weights
from gptmini.model.flops import flops_per_token
from gptmini.runtime import compile_blocker, peak_flops_of, precision_dtype
from gptmini.tokenizer import get_tokenizer
from gptmini.train.adapters import check_base, trained_weights
from gptmini.train.muon import NS_SET, NS_STEPS
from gptmini.train.optim import (
    OptimizerSettings,
    apply_changed_settings,
    check_settings,
    configure,
    warmup_for,
)
from gptmini.train.rng import every_rank_states, restore_rank_states
from gptmini.train.sharding import FSDP2Strategy, is_sharded_run, shard_model
from gptmini.train.source import load_weights
from gptmini.train.steps import OptimizerSteps, SkippedSteps, Throughput, clip_gradients
from gptmini.train.tasks import GRPOSettings, task_for


class GPTLitModule(L.LightningModule):
    """A GPT, the task it learns, and how it is optimized.

    Args:
        tokenizer: "gpt2" (offline), "byte", a saved tokenizer's path, or a tiktoken
            encoding name (see `gptmini.tokenizer.get_tokenizer`); train.py also takes
            "bpe:N", fitted to the run's corpus and saved in the run directory. The
            model's vocab_size is this tokenizer's number of ids.
        init_from: A gptmini checkpoint (.ckpt), a Hugging Face model directory or a model's
            name on the Hub (org/name) whose weights start a new run, for fine-tuning.
            train.py takes the architecture and the tokenizer from it; the model settings
            must match it, except dropout and a context_length up to the source's (a
            shorter one keeps the first position embeddings). Ignored when resuming,
            except by LoRA, whose checkpoints hold the adapters alone and load onto it.
        classes: Classification (the book's chapter 6): the class names, in the order
            of a class head that replaces the output head and reads each sequence's last
            real token. train.py sets them from --data.labels; None: a language model.
        dpo: Preference tuning (the book's chapter 7 bonus): Direct Preference
            Optimization against the starting weights (--model.init_from), frozen.
            train.py sets it for --data.preference.records; --model.dpo.beta and
            --model.dpo.variant change it.
        grpo: Reinforcement learning with verifiable rewards: GRPO's groups sampled by
            the engine from the model's own weights. train.py sets it for --data.rl.task;
            --model.grpo.* change it.
        lora_rank: LoRA (the book's appendix E): the adapters' rank; 0 trains every
            weight. With LoRA only the adapters (and a class head) train, with AdamW.
        lora_alpha: The adapters' update is scaled by lora_alpha / lora_rank.
        lora_dropout: Dropout on the adapters' input.
        lora_targets: The layers that get adapters: some of W_query, W_key, W_value,
            out_proj (the attention's projections) and mlp (every MLP layer); None: the
            four attention projections.
        learning_rate: Peak learning rate, reached after warmup (AdamW's).
        optimizer: "adamw" for every weight, or "muon": torch.optim.Muon (torch >= 2.9)
            for the blocks' matrices, AdamW for embeddings, head, norms and biases.
        muon_learning_rate: Muon's peak rate, scaled per matrix by 0.2 * sqrt(max(rows,
            cols)) to match AdamW's update size; same warmup and decay.
        muon_ns_steps: Muon's Newton-Schulz iterations per step (torch's default 5).
        muon_ns_coefficients: Their coefficients: "jordan" (torch's default, one quintic
            for every iteration) or "polar_express" (one per iteration, for 5 iterations).
        min_lr_ratio: The cosine decay ends at learning_rate * min_lr_ratio.
        warmup_steps: Optimizer steps of linear warmup from 0 (at most the run's length).
        weight_decay: AdamW weight decay, on matrices and embeddings only.
        beta1: AdamW beta1.
        beta2: AdamW beta2.
        compile: Compile the model with torch.compile.
        peak_flops: Peak FLOP/s of one device, for MFU; None looks up the GPU or
            measures the CPU's matmul rate in the training dtype, once per process.
        loss_chunk_size: Compute the head and the loss this many positions at a time,
            recomputing them in backward: far less memory for the logits (4x less for
            8 x 1024 positions of GPT-2's vocabulary) for some more time. None: at once.
        encoding: The tokenizer itself, as train.py's plan resolved it (not a flag; the
            hyperparameters keep `tokenizer`, its name or file); None: `tokenizer` names it.
        chat_template, verifier: GRPO's template and checker, as train.py's plan resolved
            them (not flags).
        **model: `GPTConfig` fields (n_layers, emb_dim, context_length, ...), with
            GPTConfig's defaults; the command line's defaults come from the default run
            config. vocab_size is not one of them: it follows the tokenizer.
    """

    # The arguments are documented in the class docstring (as torch.nn modules do theirs),
    # which --help shows for --model.*.
    def __init__(
        self,
        tokenizer: str = "gpt2",
        init_from: str | None = None,
        classes: list[str] | None = None,
        dpo: DPO | None = None,
        grpo: GRPOSettings | None = None,
        # LoRA
        lora_rank: int = 0, lora_alpha: float = 16.0, lora_dropout: float = 0.0,
        lora_targets: list[str] | None = None,
        # the optimizer and its schedule
        learning_rate: float = 1e-3, optimizer: str = "adamw", muon_learning_rate: float = 2e-3,
        muon_ns_steps: int = NS_STEPS, muon_ns_coefficients: str = NS_SET,
        min_lr_ratio: float = 0.1, warmup_steps: int = 60,
        weight_decay: float = 0.1, beta1: float = 0.9, beta2: float = 0.95,
        # how the model runs
        compile: bool = False, peak_flops: float | None = None,
        loss_chunk_size: int | None = None,
        *,
        encoding: tiktoken.Encoding | None = None,
        chat_template: ChatTemplate | None = None,
        verifier: VerifiableTask | None = None,
        **model,
    ):
        super().__init__()
        dpo, grpo = (asdict(s) if is_dataclass(s) else s for s in (dpo, grpo))  # plain data
        self.save_hyperparameters(ignore=["encoding", "chat_template", "verifier"])
        self.optimization = OptimizerSettings.of(self.hparams)  # checked: flags named
        check_settings(peak_flops=peak_flops, loss_chunk_size=loss_chunk_size)
        self.tokenizer = encoding or get_tokenizer(tokenizer)  # callbacks, checkpoints read it
        try:
            self.cfg = GPTConfig(vocab_size=self.tokenizer.n_vocab, **model)
        except ConfigError as err:  # named as the flag the user typed
            raise ValueError(err.for_flag("--model.")) from None
        self.task = task_for(tokenizer=self.tokenizer, classes=classes, dpo=dpo, grpo=grpo,
                             verifier=verifier, template=chat_template,
                             loss_chunk_size=loss_chunk_size)  # the loss, metrics, batches
        self.weights = trained_weights(rank=lora_rank, alpha=lora_alpha, dropout=lora_dropout,
                                       targets=lora_targets, init_from=init_from)  # or LoRA's
        self.model = init_gpt2_weights(GPTModel(self.cfg))  # where a run starts
        self.task_keys = self.task.prepare(self.model)  # a class head: fresh, and it trains
        self.weights.apply(self.model, self.task_keys)
        # Lightning loads a checkpoint's state_dict into this module: an adapter checkpoint
        # holds the adapters (and a class head), the base comes from init_from.
        self.strict_loading = not self.weights.keeps_base
        self.base_fingerprint: str | None = None  # of init_from's weights: LoRA's base
        self.optimizer_steps = OptimizerSteps()  # did it step at this batch: every hook asks
        self.skipped_steps = SkippedSteps()  # non-finite steps, raised at the next check
        self.throughput = Throughput(flops_per_token(self.cfg), peak_flops)
        self._rng_to_restore: list | dict | None = None
        self.compiled = False
        """Whether configure_model compiled the model (the progress bar says so while the
        first step compiles)."""
        self.resuming = False
        """Set before `trainer.fit(..., ckpt_path=...)`: Lightning names the checkpoint only
        after `setup`, which must already know not to load `init_from` (train.py sets it)."""

    # --- setup ------------------------------------------------------------------------

    def configure_model(self):
        try:
            strategy = self.trainer.strategy
        except RuntimeError:  # not attached to a Trainer
            strategy = None
        if isinstance(strategy, FSDP2Strategy):  # each block compiled, then sharded
            if not is_sharded_run(self.model):
                self.compiled = self.hparams.compile and self.can_compile()
                shard_model(self.model, strategy.mesh, str(self.trainer.precision),
                            self.compiled)
            return
        if self.hparams.compile:
            self.compile_model()

    def can_compile(self) -> bool:
        """Whether torch.compile can work on the device the model will train on (Lightning
        calls `configure_model` before moving the model there); if not, say why: the run
        trains eagerly."""
        try:
            device = self.trainer.strategy.root_device
        except RuntimeError:  # not attached to a Trainer
            device = self.device
        blocker = compile_blocker(device)
        if blocker is not None:  # the default run compiles: a newcomer's laptop still trains
            warnings.warn(f"{blocker}; training eagerly instead (the same model, slower)",
                          stacklevel=3)
        return blocker is None

    def compile_model(self) -> None:
        """Compile the model in place (parameter names, hence checkpoints, do not change),
        where it can be compiled (`can_compile`)."""
        if self.can_compile():
            self.task.compile(self.model)
            self.compiled = True

    def setup(self, stage: str):
        if stage == "fit" and self.trainer.world_size > 1:
            # Every rank draws its own dropout masks (nanoGPT offsets its seed by the rank
            # too); a resume restores each rank's own stream.
            torch.manual_seed(torch.initial_seed() + self.trainer.global_rank)
        if self.throughput.peak_flops is None:  # measured once per process, in its dtype
            dtype = precision_dtype(self.trainer.precision)
            self.throughput.peak_flops = peak_flops_of(self.device, dtype)
        if stage != "fit":
            return
        keeps = self.weights.keeps_base or self.task.needs_reference  # on a resume too
        if self.hparams.init_from and (not self.resuming or keeps):
            self.load_pretrained(self.hparams.init_from)
        self.task.start(self.model)  # the starting weights (a resume's are restored later)
        said = self.weights.summary(self.model)
        if said:
            self._say(said)

    def load_pretrained(self, source: str):
        """Copy the weights of `source` (a .ckpt or a Hugging Face directory) into this
        module's model: all of them but what the task makes new (a class head) and LoRA's
        adapters, which start fresh (see `gptmini.train.source.load_weights`)."""
        fresh = self.task_keys | set(adapter_state(self.model.state_dict()))
        self.base_fingerprint = load_weights(source, self.model, fresh=fresh,
                                             grow=not self.weights.keeps_base)

    # --- steps: the task's ----------------------------------------------------------------

    def forward(self, in_idx: Tensor) -> Tensor:
        return self.model(in_idx)

    def training_step(self, batch, batch_idx: int) -> Tensor:
        self.throughput.count(self.task.tokens(batch))
        loss, metrics = self.task.loss(self.model, batch)
        for name, value in metrics.items():  # tensors: logged without waiting on the device
            self.log(f"train/{name}", value)
        return loss

    def validation_step(self, batch, batch_idx: int):
        size = self.task.batch_size(batch)
        for name, value in self.task.validation_step(self.model, batch).items():
            self.log(f"val/{name}", value, sync_dist=True, batch_size=size)

    def on_validation_epoch_end(self):
        reduce = partial(self.trainer.strategy.reduce, reduce_op="sum")  # over every rank
        metrics = self.task.validation_end(reduce, self.trainer.callback_metrics)
        for name, value in metrics.items():  # over the whole split, every rank's
            self.log(f"val/{name}", value)

    # --- around the step: gradients, non-finite steps, throughput

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None,
                                    gradient_clip_algorithm=None):
        # One pass measures the norm (logged) and clips by it; a step that is not finite is
        # skipped on the device and reported at the next check, nothing waiting on it.
        norm = clip_gradients(list(self.parameters()), gradient_clip_val,
                              gradient_clip_algorithm)
        self.log("train/grad_norm", norm)
        self.skipped_steps.skip_if_not_finite(optimizer, norm, self.global_step,
                                              str(self.trainer.precision))

    def on_train_start(self):
        # After the sanity-check validation, so that the first resumed step draws the same
        # dropout masks the uninterrupted run drew.
        states, self._rng_to_restore = self._rng_to_restore, None
        restore_rank_states(states, self.trainer.global_rank, self.trainer.world_size)
        self.skipped_steps.reset()
        self.optimizer_steps.start(self.trainer)
        self.throughput.restart()
        dtype = precision_dtype(self.trainer.precision)
        self._say(self.throughput.describe(dtype, self.device.type))

    def on_train_batch_start(self, batch, batch_idx: int):
        self.optimizer_steps.batch_started(self.trainer)

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer, optimizer_closure=None):
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        if self.global_step % max(1, self.trainer.log_every_n_steps):
            return  # Lightning writes the logs at these same steps
        # Throughput over the logging interval (data wait, forward, backward, optimizer),
        # and the rate this step used. Logged here, not at the batch's end, because the
        # callbacks' on_train_batch_end (the progress bar's) runs before the module's: the
        # bar showed the previous interval's tokens/s.
        for name, value in self.throughput.window(self.trainer.world_size).items():
            self.log(f"train/{name}", value)
        self.log("train/lr", self.lr_schedulers().get_last_lr()[0])

    def on_train_batch_end(self, outputs, batch, batch_idx: int):
        if not self.optimizer_steps.stepped(self.trainer):
            return  # inside a gradient accumulation
        if self.global_step % max(1, self.trainer.log_every_n_steps):
            return  # Lightning writes the logs at these same steps
        self.skipped_steps.raise_if_any(self.global_step)

    def on_validation_end(self):
        self.throughput.restart()  # validation time is not training throughput

    # --- exact resume: Lightning restores weights, optimizer, schedule and loops; the
    # random number generators (dropout) of every rank are ours to carry.

    def on_save_checkpoint(self, checkpoint: dict):
        # Never a checkpoint of a run that went non-finite, nor one with NaN weights.
        self.skipped_steps.raise_if_any(self.global_step, self.parameters())
        # the model and its vocabulary, so the checkpoint is all generate.py needs
        write_model_entries(checkpoint, self.cfg, self.tokenizer, str(self.trainer.precision))
        checkpoint["state_dict"] = self.weights.saved(checkpoint["state_dict"], self.model)
        checkpoint.update(self.weights.entries(self.hparams.init_from, self.base_fingerprint))
        data = self.trainer.datamodule
        if getattr(data, "chat_template", None) is not None:  # what serving renders with
            checkpoint["chat_template"] = data.chat_template.to_dict()
        checkpoint["rng_states"] = every_rank_states(self.trainer.world_size)

    def on_load_checkpoint(self, checkpoint: dict):
        self.weights.check_resume(checkpoint)  # before Lightning loads its weights
        check_base(checkpoint, self.base_fingerprint, self.hparams.init_from)
        check_same_model(checkpoint, self.cfg)
        total = self._total_steps()
        apply_changed_settings(checkpoint, self.optimization, total_steps=total,
                               warmup_steps=warmup_for(self.optimization.warmup_steps, total),
                               announce=self.trainer is not None and self.trainer.is_global_zero)
        self._rng_to_restore = checkpoint.get("rng_states")

    # --- optimization -------------------------------------------------------------------

    def configure_optimizers(self):
        name = self.weights.optimizer(self.optimization.optimizer, say=self._say)
        return configure(self.model, replace(self.optimization, optimizer=name),
                         device=self.device, total_steps=self._total_steps(), say=self._say)

    def _say(self, line: str) -> None:
        if self.trainer.is_global_zero:
            print(line, flush=True)

    def _total_steps(self) -> int:
        total = self.trainer.max_steps
        if total is None or total < 0:
            total = int(self.trainer.estimated_stepping_batches)
        return total


def check_same_model(checkpoint: dict, cfg: GPTConfig) -> None:
    """Refuse to resume `checkpoint` into a model of another shape than `cfg` (dropout may
    change), naming each field's two values.

    Raises:
        ValueError: the model settings differ from the checkpoint's.
    """
    saved = model_config(checkpoint, cfg.vocab_size).to_dict()
    differ = [f for f in saved if f != "drop_rate" and saved[f] != getattr(cfg, f)]
    if differ:
        diffs = ", ".join(f"{f}={saved[f]!r} there, {getattr(cfg, f)!r} here" for f in differ)
        raise ValueError(f"the checkpoint holds a different model ({diffs}); resume with the "
                         "model settings it was trained with, or start a new --run_name")
