"""Training callbacks: text samples, attention maps and the progress bar."""

import warnings
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.loggers import WandbLogger

from gptmini.lit_module import GPTLitModule
from gptmini.plots import _require_matplotlib, attention_weights, plot_attention


class EveryNSteps(Callback):
    """The one guard of callbacks that act every `every_n_steps` optimizer steps, on rank 0.

    `on_train_batch_end` runs after every micro-batch, and with gradient accumulation
    several micro-batches share one `global_step`. `due` is true only at the batch whose
    optimizer step just moved `global_step` to a multiple of `every_n_steps`: once per
    step, never for the micro-batches before the first step, and never again for the step
    a resumed run starts from (it was acted on before the checkpoint).
    """

    def __init__(self, every_n_steps: int):
        self.every_n_steps = every_n_steps
        self._seen_step: int | None = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule):
        self._seen_step = trainer.global_step  # after a resume: the restored step

    def due(self, trainer: Trainer) -> bool:
        step, seen = trainer.global_step, self._seen_step
        self._seen_step = step
        stepped = step != seen and step > 0
        return (
            stepped
            and self.every_n_steps > 0
            and step % self.every_n_steps == 0
            and trainer.is_global_zero
        )


class SampleCallback(EveryNSteps):
    """Every `every_n_steps`, continue a fixed prompt and log the text.

    Printed to the console, and added to a wandb table when wandb logs the run. Sampling
    runs under a forked random generator, so it never changes the training run's dropout.
    """

    def __init__(self, every_n_steps: int = 200, prompt: str = "ROMEO:", max_new_tokens: int = 40):
        super().__init__(every_n_steps)
        self.prompt = prompt
        self.max_new_tokens = max_new_tokens

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args):
        if not self.due(trainer):
            return
        step = trainer.global_step
        text = sample_text(pl_module, self.prompt, self.max_new_tokens)
        print(f"\n[step {step}] {text!r}", flush=True)
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.log_text(key="samples", columns=["step", "text"], data=[[step, text]])


def sample_text(pl_module: GPTLitModule, prompt: str, max_new_tokens: int, seed: int = 0) -> str:
    from gptmini.generation import generate
    from gptmini.tokenizer import get_tokenizer

    tokenizer = get_tokenizer(pl_module.hparams.tokenizer)
    model = pl_module.model
    ids = tokenizer.encode(prompt, allowed_special="all") or [tokenizer.eot_token]
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


class _ShortMetrics:
    """Progress bar metrics under short names, each in a format that shows its digits."""

    SHORT = {"train/loss": ("loss", "{:.3f}"), "train/lr": ("lr", "{:.2e}"),
             "train/tokens_per_sec": ("tok/s", "{:.0f}"), "val/loss": ("val_loss", "{:.3f}")}

    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        for key, (short, fmt) in self.SHORT.items():
            if key in metrics:
                metrics[short] = fmt.format(float(metrics.pop(key)))
        return metrics


class ProgressBar(_ShortMetrics, TQDMProgressBar):
    """Lightning's tqdm bar with short metric names ("Epoch N", never Rich's "Epoch 0/-2")."""


def progress_bar() -> Callback:
    return ProgressBar()


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
        prompt: the text whose attention is drawn.
        layer: the transformer block, negative counting from the last.
    """

    def __init__(
        self,
        every_n_steps: int = 500,
        prompt: str = "ROMEO: But soft, what light",
        layer: int = -1,
    ):
        super().__init__(every_n_steps)
        self.prompt = prompt
        self.layer = layer
        self._disabled = every_n_steps <= 0

    def _disable(self, reason: str):
        warnings.warn(f"AttentionMapCallback: {reason}; no attention maps", stacklevel=2)
        self._disabled = True

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule):
        if self._disabled or not trainer.is_global_zero:
            return
        try:
            _require_matplotlib()
        except ImportError as err:
            return self._disable(str(err))
        from gptmini.tokenizer import get_tokenizer

        cfg = pl_module.model.cfg
        num_tokens = len(get_tokenizer(pl_module.hparams.tokenizer).encode(
            self.prompt, allowed_special="all") or [0])
        if num_tokens > cfg.context_length:
            return self._disable(
                f"the prompt is {num_tokens} tokens, longer than context_length "
                f"{cfg.context_length}"
            )
        if not -cfg.n_layers <= self.layer < cfg.n_layers:
            return self._disable(f"layer {self.layer} is out of range for {cfg.n_layers} layers")

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args):
        if not self.due(trainer) or self._disabled:
            return
        step = trainer.global_step
        path = self.draw(trainer, pl_module, step)
        from lightning.pytorch.loggers import WandbLogger

        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.log_image(key="attention", images=[str(path)], step=step)

    def draw(self, trainer: Trainer, pl_module: LightningModule, step: int) -> Path:
        """Compute and write the map of `step`; returns the PNG's path."""
        from gptmini.tokenizer import get_tokenizer

        tokenizer = get_tokenizer(pl_module.hparams.tokenizer)
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
