"""LoRA, the book's appendix E: a frozen linear layer plus a trainable low-rank update.

`W x + (alpha / rank) * B A dropout(x)`, with A (rank, in) drawn as nn.Linear draws its
weights and B (out, rank) zero, so a model with fresh adapters computes what its base does.
`LoRALinear` is an `nn.Linear` that keeps the base's `weight` and `bias` under their names
and adds `lora_A` and `lora_B`: a base checkpoint's keys, the Hugging Face tables and every
`isinstance(..., nn.Linear)` see the same layer. `merge_lora` folds `B A` into the weight
and gives back plain `nn.Linear`s, computing the same logits.

The book's appendix scales by `alpha` alone; this is the LoRA paper's (and PEFT's)
`alpha / rank`, so that changing the rank does not change the update's size.
"""

import hashlib
import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["DEFAULT_TARGETS", "LORA_TARGETS", "LoRALinear", "adapter_state", "adapters_off",
           "add_lora", "base_fingerprint", "check_targets", "count_parameters", "lora_layers",
           "merge_lora"]

LORA_TARGETS = ("W_query", "W_key", "W_value", "out_proj", "mlp")
"""The layers LoRA may wrap: the attention's four projections (the book's names) and every
linear layer of the MLP ("mlp": GELU's two, SwiGLU's three). The output head is left out:
its rows are the vocabulary, a fine-tune rarely needs to move them."""
DEFAULT_TARGETS = ("W_query", "W_key", "W_value", "out_proj")
"""The attention's projections: rank 8 on the default model trains 1.5% of its weights
(the MLP too would be 3.7%)."""


class LoRALinear(nn.Linear):
    """A frozen `nn.Linear` with a trainable low-rank update (shapes in the module doc).

    Args:
        base: the layer to adapt; its `weight` and `bias` are shared, not copied, and frozen.
        rank: the update's rank r.
        alpha: the update is scaled by alpha / rank.
        dropout: dropout on the adapter's input only (the base sees x unchanged).
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0):
        # Built on the meta device, then given the base's own parameters: no second copy.
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None,
                         device="meta")
        self.weight, self.bias = base.weight, base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / rank
        factory = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, **factory))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, **factory))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # nn.Linear's own draw
        self.lora_dropout = nn.Dropout(dropout)
        self.enabled = True
        """False: the base layer alone (`adapters_off`: a preference run's reference)."""

    def forward(self, x: Tensor) -> Tensor:
        if not self.enabled:
            return F.linear(x, self.weight, self.bias)
        update = F.linear(F.linear(self.lora_dropout(x), self.lora_A), self.lora_B)
        return F.linear(x, self.weight, self.bias) + self.scaling * update

    def delta(self) -> Tensor:
        """The weight update this adapter adds, (out, in): (alpha / rank) * B A."""
        return self.scaling * (self.lora_B @ self.lora_A)

    def merged(self) -> nn.Linear:
        """A plain `nn.Linear` holding W + (alpha / rank) B A (and the base's bias)."""
        layer = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                          device="meta")
        with torch.no_grad():
            layer.weight = nn.Parameter(self.weight + self.delta().to(self.weight.dtype))
        layer.bias = None if self.bias is None else nn.Parameter(self.bias.detach().clone())
        return layer

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha}"


def check_targets(targets: Iterable[str]) -> tuple[str, ...]:
    """`targets` as a tuple, or a ValueError naming an unknown one and the known ones."""
    targets = tuple(targets)
    unknown = [t for t in targets if t not in LORA_TARGETS]
    if unknown or not targets:
        raise ValueError(f"lora_targets={list(targets)}: use some of {', '.join(LORA_TARGETS)}"
                         " (mlp: every linear layer of the MLP)")
    return targets


def _target_layers(model: nn.Module, targets: tuple[str, ...]) -> list[tuple[nn.Module, str]]:
    """(parent, attribute) of every linear layer that `targets` names, in every block."""
    found = []
    for block in model.trf_blocks:
        found += [(block.att, name) for name in targets if name != "mlp"]
        if "mlp" in targets:
            found += [(parent, name) for parent, name in _linears_in(block.ff)]
    return found


def _linears_in(module: nn.Module) -> list[tuple[nn.Module, str]]:
    return [(parent, name) for parent in module.modules()
            for name, child in parent.named_children() if isinstance(child, nn.Linear)]


def add_lora(model: nn.Module, *, rank: int, alpha: float, dropout: float = 0.0,
             targets: Iterable[str] = DEFAULT_TARGETS) -> nn.Module:
    """Freeze every parameter of `model` (a GPTModel) and wrap the `targets` layers of every
    block with `LoRALinear` adapters, which alone train. In place; returns `model`.

    Raises:
        ValueError: a rank below 1 or wider than a target layer, a negative alpha, a dropout
            outside [0, 1), an unknown target, or a model that already has adapters.
    """
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"lora_rank={rank!r}: use a positive integer such as 8")
    if alpha <= 0 or not 0.0 <= dropout < 1.0:
        raise ValueError(f"lora_alpha={alpha} must be positive and lora_dropout={dropout} in "
                         "[0, 1)")
    targets = check_targets(targets)
    if lora_layers(model):
        raise ValueError("the model already has LoRA adapters: merge them (merge_lora) first")
    layers = _target_layers(model, targets)
    for parent, name in layers:
        layer = getattr(parent, name)
        widest = min(layer.in_features, layer.out_features)
        if rank > widest:  # past the layer's own rank: more weights, no more expressive
            raise ValueError(
                f"lora_rank={rank} is wider than the {name} layers ({layer.in_features} in, "
                f"{layer.out_features} out), whose updates have rank {widest} at most: its "
                f"adapters would hold {rank * (layer.in_features + layer.out_features):,} "
                f"weights against the layer's {layer.in_features * layer.out_features:,}; use "
                f"a rank of {widest} or less (LoRA's point is far less, such as "
                f"{max(1, widest // 8)})")
    model.requires_grad_(False)
    for parent, name in layers:
        setattr(parent, name, LoRALinear(getattr(parent, name), rank, alpha, dropout))
    return model


def lora_layers(model: nn.Module) -> dict[str, LoRALinear]:
    """Every adapted layer of `model`, by its module name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[nn.Module]:
    """`model` computing as its base inside the block (every adapter skipped), and as
    before after it: the weights a LoRA run started from, without a second copy of them
    (a preference run's reference model)."""
    layers = list(lora_layers(model).values())
    was = [layer.enabled for layer in layers]
    for layer in layers:
        layer.enabled = False
    try:
        yield model
    finally:
        for layer, enabled in zip(layers, was, strict=True):
            layer.enabled = enabled


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its layer (W + (alpha / rank) B A), leaving plain
    `nn.Linear`s: the same logits, no adapter cost, and a model every exporter reads.
    In place; returns `model`."""
    for name in list(lora_layers(model)):
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, attr, getattr(parent, attr).merged())
    return model


def adapter_state(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The adapters' entries of a state dict (keys ending in lora_A / lora_B)."""
    return {k: v for k, v in state.items() if k.rsplit(".", 1)[-1] in ("lora_A", "lora_B")}


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters of `model`, each shared tensor counted once."""
    seen: dict[int, nn.Parameter] = {id(p): p for p in model.parameters()}
    total = sum(p.numel() for p in seen.values())
    return sum(p.numel() for p in seen.values() if p.requires_grad), total


def base_fingerprint(state: dict[str, Tensor]) -> str:
    """A short hash of a base model's weights (names, shapes and values, adapters left out):
    adapters remember the base they were trained on, and refuse another."""
    digest = hashlib.sha256()
    for key in sorted(state):
        if key in adapter_state(state):
            continue
        value = state[key].detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{key}:{tuple(value.shape)}:{value.dtype}".encode())
        digest.update(value.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]
