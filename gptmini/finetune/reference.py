"""The reference model of preference tuning and of RL's KL term: the starting weights, frozen.

Two ways to keep them, picked by the model:

    adapters off   a LoRA model is its frozen base plus adapters: the reference is the same
                   model with its adapters skipped (`adapters_off`), no second copy; its
                   memory is nothing beyond one forward pass without gradients.
    frozen copy    a fully trained model moves every weight: the reference is a copy taken
                   before the first step, frozen and in eval mode; its memory is one more
                   set of parameters (4 bytes each in float32: 16 MB for the default 4M
                   model, 0.5 GB for GPT-2's 124M), without gradients or optimizer state.

Either way the reference sees the inputs the policy sees and computes under `no_grad`.
"""

import copy

import torch
from torch import Tensor, nn

from gptmini.finetune.lora import adapters_off, lora_layers
from gptmini.model import lm_loss


def sequence_log_probs(model: nn.Module, inputs: Tensor, targets: Tensor, *,
                       average: bool = False, loss_chunk_size: int | None = None,
                       loss_fn=lm_loss) -> Tensor:
    """Each row's log-probability of its targets (the positions that are not -100).

    Args:
        model: a GPTModel (`lm_loss` with reduction="none" gives the nats).
        inputs: (b, num_tokens) token ids.
        targets: (b, num_tokens) the next tokens, -100 where they do not count.
        average: per counted token (the book's DPO) instead of the sum (the paper's).
        loss_chunk_size: lm_loss's chunk_size.
        loss_fn: `lm_loss`, or the task's compiled one (Task.compile).

    Returns:
        (b,) float32 log-probabilities (sums, or means with `average`).
    """
    nats = loss_fn(model, inputs, targets, "none",
                   chunk_size=loss_chunk_size)  # (b, num_tokens), 0 where -100
    total = -nats.sum(-1)
    if not average:
        return total
    return total / (targets != -100).sum(-1).clamp(min=1)


def token_log_probs(model: nn.Module, inputs: Tensor, targets: Tensor, *,
                    loss_chunk_size: int | None = None, loss_fn=lm_loss) -> Tensor:
    """(b, num_tokens) the log-probability of each target (0 where it is -100), float32;
    the rest as `sequence_log_probs`."""
    return -loss_fn(model, inputs, targets, "none", chunk_size=loss_chunk_size)


class Reference:
    """The starting weights of `model`, frozen (see the module docstring for the two ways).

    Build it once the policy holds its starting weights and before the first step.
    """

    def __init__(self, model: nn.Module):
        self.uses_adapters = bool(lora_layers(model))
        self.copy: nn.Module | None = None
        if not self.uses_adapters:
            self.copy = copy.deepcopy(model).requires_grad_(False).eval()

    @property
    def extra_bytes(self) -> int:
        """Memory the reference holds beyond the policy: its copy's parameters, or 0."""
        if self.copy is None:
            return 0
        return sum(p.numel() * p.element_size() for p in self.copy.parameters())

    def __call__(self, policy: nn.Module, fn, *args, **kwargs) -> Tensor:
        """`fn(reference_model, *args, **kwargs)` without gradients, where the reference
        model is `policy` with its adapters off, or the frozen copy (moved to the policy's
        device and dtype when they differ: Lightning moves the policy after it was built)."""
        with torch.no_grad():
            if self.copy is None:
                training = policy.training
                policy.eval()  # no adapter dropout in the reference either
                try:
                    with adapters_off(policy):
                        return fn(policy, *args, **kwargs)
                finally:
                    policy.train(training)
            weight = next(policy.parameters())
            mine = next(self.copy.parameters())
            if (mine.device, mine.dtype) != (weight.device, weight.dtype):
                self.copy.to(device=weight.device, dtype=weight.dtype)
            return fn(self.copy, *args, **kwargs)
