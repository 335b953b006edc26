"""The LightningModule that trains `GPTModel`: one shared step, AdamW or Muon, warmup + cosine."""

import math
import time
import warnings

import lightning as L
import torch
from torch import Tensor
from torch.distributed.fsdp import FullyShardedDataParallel

from gptmini.checkpoint import CONFIG_FIELDS, model_config, write_model_entries
from gptmini.finetune import (
    DEFAULT_TARGETS,
    accuracy_and_confusion,
    adapter_state,
    add_class_head,
    add_lora,
    base_fingerprint,
    class_logits,
    count_parameters,
)
from gptmini.finetune.chat import grow_vocab
from gptmini.model import ConfigError, GPTConfig, GPTModel, is_finite_number
from gptmini.model.flops import flops_per_token
from gptmini.runtime import compile_blocker, peak_flops_of
from gptmini.tokenizer import get_tokenizer, token_byte_lengths
from gptmini.train.optim import (
    apply_changed_settings,
    check_muon_settings,
    check_optimizer,
    make_optimizer,
    warmup_cosine,
)
from gptmini.train.rng import rng_states, set_rng_states
from gptmini.train.steps import OptimizerSteps, SkippedSteps


class GPTLitModule(L.LightningModule):
    """A GPT and how it is optimized.

    Args:
        tokenizer: "gpt2" (offline), "byte", a saved tokenizer's path, or a tiktoken
            encoding name (see `gptmini.tokenizer.get_tokenizer`); train.py also takes
            "bpe:N", fitted to the run's corpus and saved in the run directory. The
            model's vocab_size is this tokenizer's number of ids.
        init_from: A gptmini checkpoint (.ckpt) or a Hugging Face GPT-2, Llama or Qwen3
            directory whose weights start a new run, for fine-tuning. train.py takes the
            architecture and the tokenizer from it; the model settings must match it,
            except dropout and a context_length up to the source's (a shorter one keeps
            the first position embeddings). Ignored when resuming, except by LoRA, whose
            checkpoints hold the adapters alone and load onto it.
        classes: Classification (the book's chapter 6): the class names, in the order
            of a class head that replaces the output head and reads each sequence's last
            real token. train.py sets them from --data.labels; None: a language model.
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
        lora_rank: int = 0,
        lora_alpha: float = 16.0,
        lora_dropout: float = 0.0,
        lora_targets: list[str] | None = None,
        learning_rate: float = 1e-3,
        optimizer: str = "adamw",
        muon_learning_rate: float = 2e-3,
        muon_ns_steps: int = 5,
        muon_ns_coefficients: str = "jordan",
        min_lr_ratio: float = 0.1,
        warmup_steps: int = 60,
        weight_decay: float = 0.1,
        beta1: float = 0.9,
        beta2: float = 0.95,
        compile: bool = False,
        peak_flops: float | None = None,
        loss_chunk_size: int | None = None,
        **model,
    ):
        super().__init__()
        self.save_hyperparameters()
        check_settings(learning_rate=learning_rate, muon_learning_rate=muon_learning_rate,
                       min_lr_ratio=min_lr_ratio, warmup_steps=warmup_steps,
                       weight_decay=weight_decay, beta1=beta1, beta2=beta2,
                       peak_flops=peak_flops, loss_chunk_size=loss_chunk_size)
        check_optimizer(optimizer)  # a torch without Muon fails here, before any data is read
        check_muon_settings(muon_ns_steps, muon_ns_coefficients)
        self.tokenizer = get_tokenizer(tokenizer)
        """The run's tokenizer, resolved once: callbacks and checkpoints read it here."""
        try:
            self.cfg = GPTConfig(vocab_size=self.tokenizer.n_vocab, **model)
        except ConfigError as err:  # named as the flag the user typed
            raise ValueError(err.for_flag("--model.")) from None
        self.model = GPTModel(self.cfg)
        self.lora_targets = tuple(lora_targets or DEFAULT_TARGETS)
        if classes is not None:
            add_class_head(self.model, len(classes))
        if lora_rank:
            if not init_from:
                raise ValueError(f"model.lora_rank={lora_rank} adapts a pretrained model: "
                                 "name it with --model.init_from (a .ckpt or a Hugging Face "
                                 "directory)")
            add_lora(self.model, rank=lora_rank, alpha=lora_alpha, dropout=lora_dropout,
                     targets=self.lora_targets)
            self.model.out_head.requires_grad_(classes is not None)  # a class head trains
            # Lightning loads a checkpoint's state_dict into this module: an adapter
            # checkpoint holds the adapters (and class head), the base comes from init_from.
            self.strict_loading = False
        self.base_fingerprint: str | None = None
        """The weights init_from loaded (LoRA: adapters refuse another base)."""
        self.optimizer_steps = OptimizerSteps()
        """Whether the optimizer stepped at the batch now ending: every hook reads this one."""
        self.skipped_steps = SkippedSteps()
        """Non-finite steps skipped on the device, raised at the next check."""
        self._flops_per_token = flops_per_token(self.cfg)
        self._window_start, self._window_tokens = 0.0, 0
        self._peak_flops = peak_flops
        self._rng_to_restore: dict | None = None
        self._token_bytes: Tensor | None = None  # bytes of text per id, for val/bpb
        self._val_nats = self._val_bytes = None
        self._val_confusion: Tensor | None = None  # a classifier's validation counts
        self.resuming = False
        """Set before `trainer.fit(..., ckpt_path=...)`: Lightning names the checkpoint only
        after `setup`, which must already know not to load `init_from` (train.py sets it)."""

    # --- setup ------------------------------------------------------------------------

    def configure_model(self):
        if not self.hparams.compile:
            return
        try:  # where it will train (Lightning calls this before moving the model there)
            device = self.trainer.strategy.root_device
        except RuntimeError:  # not attached to a Trainer
            device = self.device
        blocker = compile_blocker(device)
        if blocker is not None:  # the default run compiles: a newcomer's laptop still trains
            warnings.warn(f"{blocker}; training eagerly instead (the same model, slower)",
                          stacklevel=2)
            return
        self.model.compile()  # in place: parameter names (checkpoints) do not change

    def setup(self, stage: str):
        if stage == "fit" and self.trainer.world_size > 1:
            # Every rank draws its own dropout masks (nanoGPT offsets its seed by the rank
            # too); a resume restores each rank's own stream.
            torch.manual_seed(torch.initial_seed() + self.trainer.global_rank)
        if self._peak_flops is None:
            self._peak_flops = peak_flops_of(self.device, self._compute_dtype())
        if stage == "fit" and self.hparams.init_from and (not self.resuming
                                                          or self.hparams.lora_rank):
            self.load_pretrained(self.hparams.init_from)
        if stage == "fit" and self.hparams.lora_rank and self.trainer.is_global_zero:
            trainable, total = count_parameters(self.model)
            print(f"LoRA rank {self.hparams.lora_rank} on {', '.join(self.lora_targets)}"
                  f": {trainable:,} of {total:,} parameters train ({trainable / total:.2%})",
                  flush=True)

    def load_pretrained(self, source: str):
        """Copy the weights of `source` (a .ckpt or a Hugging Face directory) into this
        module's model: all of them but a class head and LoRA adapters, which start fresh.

        Raises:
            ValueError: the source holds a different architecture (naming each field,
                its value there and the flag that matches it).
        """
        from gptmini.checkpoint import load_checkpoint

        pretrained = load_checkpoint(source).model
        # What a LoRA checkpoint will find on disk, before a chat template grows it.
        self.base_fingerprint = base_fingerprint(pretrained.state_dict())
        if pretrained.cfg.vocab_size < self.cfg.vocab_size:  # a chat template's new tokens
            if self.hparams.lora_rank:
                raise ValueError(
                    f"model.init_from={source}: the chat template adds tokens to its "
                    "vocabulary, whose new embedding rows LoRA would never train: use "
                    "--data.chat.template book (it adds none), or fine-tune fully (no "
                    "--model.lora_rank)")
            grow_vocab(pretrained, self.cfg.vocab_size)
        theirs, ours = pretrained.cfg, self.cfg
        differ = architecture_differences(theirs, ours)
        if differ:
            wanted = " ".join(f"--model.{f} {getattr(theirs, f)}" for f in differ)
            raise ValueError(
                f"model.init_from={source} holds a different model "
                f"({', '.join(f'{f}={getattr(theirs, f)!r}' for f in differ)}); set {wanted}"
            )
        state = pretrained.state_dict()
        if "pos_emb.weight" in state:
            state["pos_emb.weight"] = state["pos_emb.weight"][: ours.context_length]
        fresh = set(adapter_state(self.model.state_dict()))
        if self.hparams.classes is not None:
            state = {k: v for k, v in state.items() if not k.startswith("out_head.")}
            fresh |= {k for k in self.model.state_dict() if k.startswith("out_head.")}
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        if set(missing) - fresh or unexpected:
            raise ValueError(f"model.init_from={source}: its weights do not fit this model "
                             f"(missing {sorted(set(missing) - fresh)[:3]}, unexpected "
                             f"{sorted(unexpected)[:3]})")

    # --- steps --------------------------------------------------------------------------

    def forward(self, in_idx: Tensor) -> Tensor:
        return self.model(in_idx)

    def _loss(self, batch) -> Tensor:
        # (inputs, targets) or, with document masks, (inputs, targets, document ids): each
        # (b, num_tokens). The loss is computed inside the model.
        inputs, targets, *documents = batch
        return self.model(inputs, targets=targets, document_ids=documents[0] if documents
                          else None, loss_chunk_size=self.hparams.loss_chunk_size)

    def _class_loss(self, batch) -> tuple[Tensor, Tensor]:
        """A classification batch (ids, attention mask, labels): the cross-entropy of the
        class logits at each sequence's last real token, and the predicted classes."""
        ids, mask, labels = batch
        logits = class_logits(self.model, ids, mask).float()  # (b, num_classes)
        return torch.nn.functional.cross_entropy(logits, labels), logits.argmax(-1)

    def training_step(self, batch, batch_idx: int) -> Tensor:
        loss = self._class_loss(batch)[0] if self.hparams.classes else self._loss(batch)
        self.log("train/loss", loss)  # a tensor: logged without waiting (the bar reads it)
        return loss

    def on_validation_epoch_start(self):
        if self.hparams.classes:
            self._val_confusion = torch.zeros(len(self.hparams.classes), len(self.hparams.classes),
                                              dtype=torch.long)
            return
        self._val_nats = torch.zeros((), dtype=torch.float32, device=self.device)
        self._val_bytes = torch.zeros((), dtype=torch.long, device=self.device)
        if self._token_bytes is None or self._token_bytes.device != self.device:
            lengths = token_byte_lengths(self.tokenizer)
            self._token_bytes = torch.tensor(lengths, device=self.device)

    def validation_step(self, batch, batch_idx: int):
        if self.hparams.classes:
            loss, predicted = self._class_loss(batch)
            self.log("val/loss", loss, sync_dist=True, batch_size=len(predicted))
            num_classes = len(self.hparams.classes)
            self._val_confusion += accuracy_and_confusion(predicted, batch[2], num_classes)[1]
            return
        inputs, targets, *documents = batch
        # A compiled model would compile a second graph for this (no gradients, per-token
        # losses, the last batch's shape): on a CPU that costs more than a run's validations.
        with torch.compiler.set_stance("force_eager"):
            nats = self.model(inputs, targets=targets, reduction="none",
                              document_ids=documents[0] if documents else None,
                              loss_chunk_size=self.hparams.loss_chunk_size)
        counted = targets != -100  # cross_entropy's ignore_index
        self.log("val/loss", nats.sum() / counted.sum(), sync_dist=True)
        # Bits per byte compares tokenizers: the nats of the targets over the bytes of text
        # they stand for. Special tokens stand for no text: they leave both sums.
        num_bytes = self._token_bytes[targets.clamp(min=0)] * counted
        self._val_nats += (nats * (num_bytes > 0)).sum()
        self._val_bytes += num_bytes.sum()

    def on_validation_epoch_end(self):
        if self.hparams.classes:  # accuracy over the whole split, every rank's examples
            confusion = self.trainer.strategy.reduce(self._val_confusion.to(self.device),
                                                     reduce_op="sum")
            self.log("val/acc", confusion.diag().sum() / confusion.sum().clamp(min=1))
            return
        val_loss = self.trainer.callback_metrics.get("val/loss")
        if val_loss is not None:
            self.log("val/ppl", torch.exp(val_loss), sync_dist=True)
        nats = self.trainer.strategy.reduce(self._val_nats, reduce_op="sum")
        num_bytes = self.trainer.strategy.reduce(self._val_bytes, reduce_op="sum")
        self.log("val/bpb", nats / num_bytes.clamp(min=1) / math.log(2))

    # --- non-finite steps: skipped on the device, reported at the next check

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None,
                                    gradient_clip_algorithm=None):
        # One pass over the gradients measures their norm (logged), clips by it, and tells
        # the optimizer whether the step is finite, all without waiting on the device.
        if gradient_clip_algorithm == "value":
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g)
                                                         for g in grads]))
            torch.nn.utils.clip_grad_value_(self.parameters(), gradient_clip_val)
        else:
            max_norm = gradient_clip_val or math.inf  # None or 0: measure, do not clip
            wrapped = self.trainer.strategy.model
            if isinstance(wrapped, FullyShardedDataParallel):
                norm = wrapped.clip_grad_norm_(max_norm)  # over the shards of every rank
            else:
                norm = torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm)
        self.log("train/grad_norm", norm)
        self._skip_if_not_finite(optimizer, norm)

    def _skip_if_not_finite(self, optimizer, norm: Tensor) -> None:
        """A NaN or infinite loss or gradient never updates the weights.

        Fused AdamW skips its update on the device when `found_inf` is set (what a grad
        scaler does), so nothing waits for the answer; the step is counted on the device
        and reported at the next logging step or checkpoint save. fp16 mixed precision
        overflows on purpose and its grad scaler skips those steps itself.
        """
        if str(self.trainer.precision) == "16-mixed":
            return
        bad = ~torch.isfinite(norm)  # a NaN loss makes NaN gradients, hence a NaN norm
        if optimizer.defaults.get("fused"):
            optimizer.found_inf = bad.float()
        elif bool(bad):  # an optimizer without on-device skipping: wait, and skip here
            optimizer.zero_grad(set_to_none=True)
        self.skipped_steps.record(bad, self.global_step)

    def on_train_start(self):
        self._restore_rng_states()
        self.skipped_steps.reset()
        self.optimizer_steps.start(self.trainer)
        self._window_start, self._window_tokens = time.perf_counter(), 0
        if self.trainer.is_global_zero:
            peak = f"{self._peak_flops / 1e12:.3g} TFLOP/s" if self._peak_flops else "unknown"
            print(f"MFU: tokens/s x {self._flops_per_token / 1e6:.1f} MFLOP per token (6N + "
                  "attention, gptmini.model.flops; N = matmul weights with the head) / peak "
                  f"({peak} for {self._dtype_name()} on {self.device.type})", flush=True)

    def on_train_batch_start(self, batch, batch_idx: int):
        self.optimizer_steps.batch_started(self.trainer)

    def on_train_batch_end(self, outputs, batch, batch_idx: int):
        self._window_tokens += batch[0].numel()
        if not self.optimizer_steps.stepped(self.trainer):
            return  # inside a gradient accumulation
        if self.global_step % max(1, self.trainer.log_every_n_steps):
            return  # Lightning writes the logs at these same steps
        self.skipped_steps.raise_if_any(self.global_step)
        # Throughput over the logging interval (data wait, forward, backward, optimizer).
        now = time.perf_counter()
        tokens_per_sec = self._window_tokens * self.trainer.world_size / (now - self._window_start)
        self._window_start, self._window_tokens = now, 0
        self.log("train/tokens_per_sec", tokens_per_sec)
        if self._peak_flops:
            mfu = self._flops_per_token * tokens_per_sec / (self._peak_flops
                                                             * self.trainer.world_size)
            self.log("train/mfu", mfu)
        self.log("train/lr", self.lr_schedulers().get_last_lr()[0])

    def on_validation_end(self):
        # Validation time is not training throughput: the interval restarts after it.
        self._window_start, self._window_tokens = time.perf_counter(), 0

    # --- exact resume: Lightning restores weights, optimizer, schedule and loops; the
    # random number generators (dropout) of every rank are ours to carry.

    def on_save_checkpoint(self, checkpoint: dict):
        # Never a checkpoint of a run that went non-finite, nor one with NaN weights.
        self.skipped_steps.raise_if_any(self.global_step)
        if not all(bool(torch.isfinite(p).all()) for p in self.parameters()):
            raise FloatingPointError(
                f"the weights hold NaN or infinite values at step {self.global_step}, so no "
                "checkpoint was written; the last one is intact. Resume from it with a lower "
                "--model.learning_rate: --ckpt_path last"
            )
        # the model and its vocabulary, so the checkpoint is all generate.py needs
        write_model_entries(checkpoint, self.cfg, self.tokenizer, str(self.trainer.precision))
        if self.hparams.lora_rank:
            self._keep_adapters_only(checkpoint)
        data = self.trainer.datamodule
        if getattr(data, "chat_template", None) is not None:  # what serving renders with
            checkpoint["chat_template"] = data.chat_template.to_dict()
        states = rng_states()
        if self.trainer.world_size > 1 and torch.distributed.is_initialized():
            per_rank = [None] * self.trainer.world_size  # every rank saves; rank 0 writes
            torch.distributed.all_gather_object(per_rank, states)
        else:
            per_rank = [states]
        checkpoint["rng_states"] = per_rank

    def _keep_adapters_only(self, checkpoint: dict) -> None:
        """A LoRA run's checkpoint holds what trains (adapters, a class head) and the base
        it adapts, by path and by fingerprint; the frozen weights stay in the base."""
        trainable = {f"model.{n}" for n, p in self.model.named_parameters() if p.requires_grad}
        state = checkpoint["state_dict"]
        checkpoint["state_dict"] = {k: v for k, v in state.items() if k in trainable}
        hp = self.hparams
        checkpoint["lora"] = {"base": str(hp.init_from), "base_fingerprint": self.base_fingerprint,
                              "rank": hp.lora_rank, "alpha": hp.lora_alpha,
                              "dropout": hp.lora_dropout, "targets": list(self.lora_targets)}

    def on_load_checkpoint(self, checkpoint: dict):
        saved_lora = checkpoint.get("lora")
        if saved_lora and self.base_fingerprint not in (None, saved_lora["base_fingerprint"]):
            raise ValueError(
                f"the checkpoint's adapters were trained on {saved_lora['base']} (weights "
                f"{saved_lora['base_fingerprint']}), and model.init_from={self.hparams.init_from}"
                f" holds other weights ({self.base_fingerprint}): resume with the base they "
                "were trained on")
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
        apply_changed_settings(checkpoint, self.hparams, warmup_steps=self._warmup_steps(),
                               total_steps=self._total_steps(),
                               announce=self.trainer is not None and self.trainer.is_global_zero)
        self._rng_to_restore = checkpoint.get("rng_states")

    def _restore_rng_states(self):
        # Restored at train start, after the sanity-check validation, so that the first
        # resumed step draws the same dropout masks the uninterrupted run drew.
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
        name = hp.optimizer
        if hp.lora_rank and name == "muon":
            # Muon would orthogonalize each adapter's update: every singular value of a
            # rank-r step set to one, whatever the gradient's spectrum, at a rate scaled by
            # the wide side. LoRA is an AdamW method (the paper, the book's appendix E).
            name = "adamw"
            if self.trainer.is_global_zero:
                print("LoRA: the adapters train with AdamW (--model.optimizer muon applies to "
                      "full fine-tuning)", flush=True)
        sharded = name == "muon" and isinstance(self.trainer.strategy.model,
                                                        FullyShardedDataParallel)
        optimizer = make_optimizer(self.model, name, learning_rate=hp.learning_rate,
                                   muon_learning_rate=hp.muon_learning_rate,
                                   weight_decay=hp.weight_decay, betas=(hp.beta1, hp.beta2),
                                   device=self.device, sharded=sharded,
                                   muon_ns_steps=hp.get("muon_ns_steps", 5),
                                   muon_ns_coefficients=hp.get("muon_ns_coefficients", "jordan"))
        schedule = warmup_cosine(optimizer, warmup_steps=self._warmup_steps(),
                                 total_steps=self._total_steps(), min_ratio=hp.min_lr_ratio,
                                 asked_warmup=hp.warmup_steps)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": schedule, "interval": "step", "frequency": 1},
        }

    def _compute_dtype(self) -> torch.dtype:
        """The dtype the matmuls run in, from the trainer's precision."""
        precision = str(self.trainer.precision)
        if precision.startswith("bf16"):
            return torch.bfloat16
        return torch.float16 if precision.startswith("16") else torch.float32

    def _dtype_name(self) -> str:
        return str(self._compute_dtype()).removeprefix("torch.")

    def _total_steps(self) -> int:
        total = self.trainer.max_steps
        if total is None or total < 0:
            total = int(self.trainer.estimated_stepping_batches)
        return total

    def _warmup_steps(self) -> int:
        return min(self.hparams.warmup_steps, self._total_steps())


CHANGEABLE_FIELDS = ("drop_rate", "attn_drop_rate", "attention_backend", "context_length")
"""What a fine-tune may set differently from its init_from source: dropout, the attention
kernel, and a context_length up to the source's; every other GPTConfig field is its
architecture, taken from the source."""


def architecture_differences(source: GPTConfig, cfg: GPTConfig) -> list[str]:
    """The GPTConfig fields where `cfg` contradicts the architecture of `source`: every field
    but CHANGEABLE_FIELDS, and a context_length past the source's. Spellings of the same
    model agree (n_kv_heads None is n_heads, head_dim None emb_dim / n_heads, mlp_hidden_dim
    None its default width, padded_vocab_size None is vocab_size)."""
    same = {"n_kv_heads": lambda c: c.n_kv_heads or c.n_heads,
            "head_dim": lambda c: c.head_size,
            "mlp_hidden_dim": lambda c: c.hidden_dim,
            "padded_vocab_size": lambda c: c.vocab_width}
    differ = [f for f in CONFIG_FIELDS if f not in CHANGEABLE_FIELDS
              and same.get(f, lambda c, f=f: getattr(c, f))(source)
              != same.get(f, lambda c, f=f: getattr(c, f))(cfg)]
    if cfg.context_length > source.context_length:
        differ.append("context_length")
    return differ


def contradictions(source: GPTConfig, given: dict) -> list[str]:
    """The fields of `given` (GPTConfig fields a user set) that contradict the architecture
    of `source` (see `architecture_differences`), in `given`'s order."""
    merged = {**source.to_dict(), **given}
    try:
        differ = architecture_differences(source, GPTConfig(**merged))
    except (TypeError, ValueError):  # an invalid combination: compare the values as given
        differ = [f for f in given if merged[f] != getattr(source, f)]
    return [f for f in given if f in differ]


def _check_range(name: str, value: float, low: float, high: float):
    if not low <= value <= high:
        raise ValueError(f"model.{name}={value} must be in [{low}, {high}]")


SETTINGS = {  # name: (the range it must be in, what to use)
    "learning_rate": (lambda x: x > 0, "a positive number such as 1e-3"),
    "muon_learning_rate": (lambda x: x > 0, "a positive number such as 2e-3"),
    "min_lr_ratio": (lambda x: 0 <= x <= 1, "a number in [0, 1]"),
    "warmup_steps": (lambda x: x >= 0, "an integer, 0 or more"),
    "weight_decay": (lambda x: x >= 0, "a number, 0 or more, such as 0.1"),
    # A beta of 1 never forgets: the moment estimates stay at their start.
    "beta1": (lambda x: 0 <= x < 1, "a number in [0, 1), such as 0.9"),
    "beta2": (lambda x: 0 <= x < 1, "a number in [0, 1), such as 0.95"),
    "peak_flops": (lambda x: x > 0, "a positive number of FLOP/s, or None to measure it"),
    "loss_chunk_size": (lambda x: x >= 1, "an integer, 1 or more, or None for all at once"),
}
"""GPTLitModule's optimization settings: each a finite number in its range."""


def check_settings(**values) -> None:
    """Refuse a setting of `SETTINGS` that is not a finite number in its range (None where
    the setting allows it), naming its flag.

    Raises:
        ValueError: e.g. "--model.beta1 1.5 is invalid: use a number in [0, 1), such as 0.9".
    """
    for name, value in values.items():
        in_range, what = SETTINGS[name]
        if value is None and "None" in what:
            continue
        kind_ok = isinstance(value, int) if what.startswith("an integer") else True
        if not (is_finite_number(value) and kind_ok and in_range(value)):
            raise ValueError(f"--model.{name} {value!r} is invalid: use {what}")
