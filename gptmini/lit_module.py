"""The LightningModule that trains `GPTModel`: one shared step, AdamW, warmup + cosine."""

import math
import random
import time
import warnings

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.fsdp import FullyShardedDataParallel

from gptmini.checkpoint import model_config
from gptmini.model import GPTConfig, GPTModel, flops_per_token
from gptmini.tokenizer import get_tokenizer

# Dense bf16 peak FLOP/s of common accelerators (vendor datasheets, no sparsity).
PEAK_FLOPS_BY_DEVICE = {
    "H100": 989e12,
    "H200": 989e12,
    "A100": 312e12,
    "A10G": 125e12,
    "A10": 125e12,
    "L40S": 362e12,
    "L4": 121e12,
    "V100": 125e12,
    "RTX 4090": 165e12,
    "RTX 3090": 71e12,
    "T4": 65e12,
}


class GPTLitModule(L.LightningModule):
    def __init__(
        self,
        tokenizer: str = "gpt2",
        init_from: str | None = None,
        learning_rate: float = 1e-3,
        min_lr_ratio: float = 0.1,
        warmup_steps: int = 60,
        weight_decay: float = 0.1,
        beta1: float = 0.9,
        beta2: float = 0.95,
        compile: bool = False,
        peak_flops: float | None = None,
        **model,
    ):
        """A GPT and how it is optimized.

        Args:
            tokenizer: tiktoken encoding name; "gpt2" works offline. The model's vocab_size is
                this tokenizer's number of ids.
            init_from: A Hugging Face GPT-2 directory (`save_pretrained` layout) whose
                weights start a new run, for fine-tuning; the model settings must match
                its config.json, except that a shorter context_length keeps the first
                context_length position embeddings. Ignored when resuming a checkpoint.
            learning_rate: Peak learning rate, reached after warmup.
            min_lr_ratio: The cosine decay ends at learning_rate * min_lr_ratio.
            warmup_steps: Optimizer steps of linear warmup from 0 (at most the run's length).
            weight_decay: AdamW weight decay, on matrices and embeddings only.
            beta1: AdamW beta1.
            beta2: AdamW beta2.
            compile: Compile the model with torch.compile.
            peak_flops: Peak FLOP/s of one device, for MFU; None looks up the GPU or
                measures the CPU's fp32 matmul rate once at start.
            **model: `GPTConfig` fields (n_layers, emb_dim, context_length, ...), with
                GPTConfig's defaults; the command line's defaults come from the default run
                config. vocab_size is not one of them: it follows the tokenizer.
        """
        super().__init__()
        self.save_hyperparameters()
        _check_range("learning_rate", learning_rate, 1e-12, math.inf)
        _check_range("warmup_steps", warmup_steps, 0, math.inf)
        _check_range("min_lr_ratio", min_lr_ratio, 0.0, 1.0)
        _check_range("weight_decay", weight_decay, 0.0, math.inf)
        self.cfg = GPTConfig(vocab_size=get_tokenizer(tokenizer).n_vocab, **model)
        self.model = GPTModel(self.cfg)
        self._flops_per_token = flops_per_token(self.cfg)
        self._last_step_time: float | None = None
        self._peak_flops = peak_flops
        self._rng_to_restore: dict | None = None
        self.resuming = False
        """Set before `trainer.fit(..., ckpt_path=...)`: Lightning names the checkpoint only
        after `setup`, which must already know not to load `init_from` (train.py sets it)."""

    # --- setup ------------------------------------------------------------------------

    def configure_model(self):
        if self.hparams.compile:
            self.model.compile()  # in place: parameter names (checkpoints) do not change

    def setup(self, stage: str):
        if stage == "fit" and self.trainer.world_size > 1:
            # Every rank draws its own dropout masks (nanoGPT offsets its seed by the rank
            # too); a resume restores each rank's own stream.
            torch.manual_seed(torch.initial_seed() + self.trainer.global_rank)
        if self._peak_flops is None:
            self._peak_flops = peak_flops_of(self.device)
        if stage == "fit" and self.hparams.init_from and not self.resuming:
            self.load_pretrained(self.hparams.init_from)

    def load_pretrained(self, directory: str):
        """Copy a Hugging Face GPT-2's weights into this module's model."""
        from gptmini.convert import load_hf

        pretrained = load_hf(directory)
        theirs, ours = pretrained.cfg.fit_vocab(self.cfg.vocab_size), self.cfg
        shape_fields = ("vocab_size", "padded_vocab_size", "emb_dim", "n_heads", "n_layers",
                        "qkv_bias", "tie_weights")
        differ = [f for f in shape_fields if getattr(theirs, f) != getattr(ours, f)]
        if ours.context_length > theirs.context_length:
            differ.append("context_length")
        if ours.n_kv_heads not in (None, ours.n_heads):
            differ.append("n_kv_heads")
        if differ:
            wanted = " ".join(f"--model.{f} {getattr(theirs, f)}" for f in differ)
            raise ValueError(
                f"model.init_from={directory} holds a different model "
                f"({', '.join(f'{f}={getattr(theirs, f)!r}' for f in differ)}); set {wanted}"
            )
        state = pretrained.state_dict()
        state["pos_emb.weight"] = state["pos_emb.weight"][: ours.context_length]
        self.model.load_state_dict(state, strict=True)

    # --- steps --------------------------------------------------------------------------

    def forward(self, in_idx: Tensor) -> Tensor:
        return self.model(in_idx)

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        inputs, targets = batch  # (b, num_tokens) each
        logits = self.model(inputs)  # (b, num_tokens, vocab_size)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def training_step(self, batch, batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        if not torch.isfinite(loss):
            raise FloatingPointError(
                f"loss is {loss.item()} at step {self.global_step}; the run stops here and the "
                "last checkpoint (saved before this step) is intact. Lower "
                "--model.learning_rate, raise --model.warmup_steps or set "
                "--trainer.gradient_clip_val, then resume with --ckpt_path last"
            )
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx: int):
        loss = self._loss(batch)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)

    def on_validation_epoch_end(self):
        val_loss = self.trainer.callback_metrics.get("val/loss")
        if val_loss is not None:
            self.log("val/ppl", torch.exp(val_loss), sync_dist=True)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None,
                                    gradient_clip_algorithm=None):
        # One pass over the gradients measures their norm (logged, and checked before the
        # weights change) and clips by it.
        if gradient_clip_algorithm == "value":
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            norms = torch.stack([torch.linalg.vector_norm(g) for g in grads])
            self._check_grad_norm(torch.linalg.vector_norm(norms))
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
            return
        max_norm = gradient_clip_val or math.inf  # None or 0: measure, do not clip
        wrapped = self.trainer.strategy.model
        if isinstance(wrapped, FullyShardedDataParallel):
            norm = wrapped.clip_grad_norm_(max_norm)  # over the shards of every rank
        else:
            norm = torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm)
        self._check_grad_norm(norm)

    def _check_grad_norm(self, norm: Tensor):
        # fp16 mixed precision overflows on purpose; its grad scaler skips those steps.
        if not torch.isfinite(norm) and not str(self.trainer.precision).startswith("16"):
            raise FloatingPointError(
                f"gradient norm is {norm.item()} at step {self.global_step}; the weights were "
                "not updated and the last checkpoint is intact. Lower --model.learning_rate "
                "or set --trainer.gradient_clip_val, then resume with --ckpt_path last"
            )
        self.log("train/grad_norm", norm)

    def on_train_batch_end(self, outputs, batch, batch_idx: int):
        # Throughput over the whole step (data wait, forward, backward, optimizer).
        now = time.perf_counter()
        if self._last_step_time is not None:
            tokens = batch[0].numel() * self.trainer.world_size
            tokens_per_sec = tokens / (now - self._last_step_time)
            self.log("train/tokens_per_sec", tokens_per_sec, prog_bar=True)
            peak = self._peak_flops
            if peak:
                mfu = self._flops_per_token * tokens_per_sec / (peak * self.trainer.world_size)
                self.log("train/mfu", mfu)
        self._last_step_time = now
        self.log("train/lr", self.lr_schedulers().get_last_lr()[0], prog_bar=True)

    def on_validation_start(self):
        self._last_step_time = None  # validation time is not training throughput

    # --- exact resume: Lightning restores weights, optimizer, schedule and loops; the
    # random number generators (dropout) of every rank are ours to carry.

    def on_save_checkpoint(self, checkpoint: dict):
        checkpoint["model_config"] = self.cfg.to_dict()  # rebuilds the model without us
        states = rng_states()
        if self.trainer.world_size > 1 and torch.distributed.is_initialized():
            per_rank = [None] * self.trainer.world_size  # every rank saves; rank 0 writes
            torch.distributed.all_gather_object(per_rank, states)
        else:
            per_rank = [states]
        checkpoint["rng_states"] = per_rank

    def on_load_checkpoint(self, checkpoint: dict):
        saved = model_config(checkpoint, self.cfg.vocab_size).to_dict()
        shape_fields = [f for f in saved if f != "drop_rate"]
        differ = [f for f in shape_fields if saved[f] != getattr(self.cfg, f)]
        if differ:
            diffs = ", ".join(
                f"{f}={saved[f]!r} there, {getattr(self.cfg, f)!r} here" for f in differ
            )
            raise ValueError(
                f"the checkpoint holds a different model ({diffs}); resume with the model "
                "settings it was trained with, or start a new --run_name"
            )
        self._apply_changed_optimization(checkpoint)
        self._rng_to_restore = checkpoint.get("rng_states")

    def _apply_changed_optimization(self, checkpoint: dict) -> None:
        """Resume with this run's optimization settings, not the checkpoint's.

        The restored optimizer and schedule would otherwise keep the old learning rate,
        weight decay and betas. The schedule is a function of the step, so it continues
        from the step reached as the new settings draw it.
        """
        saved, hp = checkpoint.get("hyper_parameters", {}), self.hparams
        changed = [f for f in OPTIMIZATION_FIELDS if f in saved and saved[f] != hp[f]]
        if not changed:
            return
        if self.trainer is not None and self.trainer.is_global_zero:
            diffs = ", ".join(f"{f} {saved[f]} -> {hp[f]}" for f in changed)
            print(f"resuming with changed settings: {diffs}", flush=True)
        for schedule in checkpoint.get("lr_schedulers", []):
            step = schedule.get("last_epoch", 0)
            lr = hp.learning_rate * lr_factor(step, self._warmup_steps(), self._total_steps(),
                                              hp.min_lr_ratio)
            schedule["base_lrs"] = [hp.learning_rate] * len(schedule.get("base_lrs", []))
            schedule["_last_lr"] = [lr] * len(schedule.get("_last_lr", []))
        for optimizer in checkpoint.get("optimizer_states", []):
            for i, group in enumerate(optimizer.get("param_groups", [])):
                group.update(lr=lr, initial_lr=hp.learning_rate, betas=(hp.beta1, hp.beta2))
                if i == 0:  # configure_optimizers' first group is the decayed one
                    group["weight_decay"] = hp.weight_decay

    def on_train_start(self):
        # Restored here, after the sanity-check validation, so that the first resumed step
        # draws the same dropout masks the uninterrupted run drew.
        states, self._rng_to_restore = self._rng_to_restore, None
        if not states:
            return
        if isinstance(states, dict):  # checkpoints from before one state per rank
            states = [states]
        rank, world = self.trainer.global_rank, self.trainer.world_size
        if len(states) != world:
            warnings.warn(
                f"the checkpoint holds the random state of {len(states)} rank(s) and this run "
                f"has {world}: dropout will differ from an uninterrupted run",
                stacklevel=2,
            )
        set_rng_states(states[rank % len(states)])

    # --- optimization -------------------------------------------------------------------

    def configure_optimizers(self):
        hp = self.hparams
        params = [p for p in self.parameters() if p.requires_grad]
        # Decay matrices and embeddings; leave biases and LayerNorm gains alone.
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": hp.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(
            groups,
            lr=hp.learning_rate,
            betas=(hp.beta1, hp.beta2),
            fused=self.device.type == "cuda",
        )
        total, warmup = self._total_steps(), self._warmup_steps()
        if warmup < hp.warmup_steps:  # a short trial run (fast_dev_run, a few max_steps)
            warnings.warn(
                f"model.warmup_steps={hp.warmup_steps} is longer than the run ({total} "
                f"optimizer steps); warming up over all {total} instead",
                stacklevel=2,
            )
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_factor(step, warmup, total, hp.min_lr_ratio)
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": schedule, "interval": "step", "frequency": 1},
        }

    def _total_steps(self) -> int:
        total = self.trainer.max_steps
        if total is None or total < 0:
            total = int(self.trainer.estimated_stepping_batches)
        return total

    def _warmup_steps(self) -> int:
        return min(self.hparams.warmup_steps, self._total_steps())


OPTIMIZATION_FIELDS = ("learning_rate", "min_lr_ratio", "warmup_steps", "weight_decay", "beta1",
                       "beta2")
"""Settings a resumed run may change; the model's shape may not."""


def rng_states() -> dict:
    """This process's random generators: torch (CPU, and CUDA when present) and Python's."""
    states = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(_as_tuples(states["python"]))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def lr_factor(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine decay to `min_ratio` at `total_steps`, then flat."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def peak_flops_of(device: torch.device) -> float | None:
    """Peak FLOP/s of one device: a table for known GPUs, a measurement on CPU."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, flops in PEAK_FLOPS_BY_DEVICE.items():
            if key in name:
                return flops
        return None  # unknown GPU: no MFU rather than a wrong one
    if device.type == "cpu":
        return measure_matmul_flops()
    return None


def measure_matmul_flops(size: int = 1024, seconds: float = 0.5) -> float:
    """The CPU's fp32 matmul rate in FLOP/s, measured over about `seconds`."""
    gen = torch.Generator().manual_seed(0)  # leaves the global generator (dropout) alone
    a, b = torch.randn(size, size, generator=gen), torch.randn(size, size, generator=gen)
    a @ b  # warm up threads and caches
    runs, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        a @ b
        runs += 1
    return 2 * size**3 * runs / elapsed


def _as_tuples(value):
    """random.setstate wants the tuples that a checkpoint round trip may turn into lists."""
    return tuple(_as_tuples(v) for v in value) if isinstance(value, list | tuple) else value


def _check_range(name: str, value: float, low: float, high: float):
    if not low <= value <= high:
        raise ValueError(f"model.{name}={value} must be in [{low}, {high}]")
