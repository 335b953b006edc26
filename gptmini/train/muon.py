"""Muon (Jordan et al. 2024): momentum orthogonalized by Newton-Schulz iterations, on the
hidden matrices, beside AdamW on the rest, as one optimizer (`MuonAdamW`, which `muon_adamw`
builds for a model). torch.optim.Muon does the math; `BatchedMuon` orthogonalizes the
same-shape matrices in one batched call and whole matrices of FSDP2 shards
(`sharded_orthogonalize`). gptmini.train.optim chooses between it and AdamW.
"""

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from gptmini.runtime import device_has_bf16

__all__ = ["MUON_ADJUST_LR", "MUON_TORCH", "NS_COEFFICIENTS", "NS_SET", "NS_STEPS", "BatchedMuon",
           "MuonAdamW", "check_muon_settings", "is_muon_group", "muon_adamw", "muon_class",
           "newton_schulz_dtype", "orthogonalize", "sharded_orthogonalize"]

MUON_TORCH = "2.9"
"""The first torch release with `torch.optim.Muon`."""
MUON_ADJUST_LR = "match_rms_adamw"
"""torch Muon's per-shape rate: 0.2 * sqrt(max(rows, cols)) x its lr, so that an update's
RMS is AdamW's (Moonshot's "Muon is Scalable"), and the AdamW weight decay carries over."""


NS_COEFFICIENTS: dict[str, tuple[float, tuple[tuple[float, float, float], ...]]] = {
    # Keller Jordan's quintic (https://kellerjordan.github.io/posts/muon/), torch.optim.Muon's
    # default: one (a, b, c) for every iteration, its slope at 0 maximized; 5 iterations
    # leave the singular values in about [0.7, 1.2].
    "jordan": (1.0, ((3.4445, -4.7750, 2.0315),)),
    # Polar Express (Amsel, Persson, Musco, Gower 2025, arXiv 2505.16932, Algorithm 1 with
    # num_iters=5, safety factor 2e-2, cushion 2), as modded-nanogpt's record log and
    # nanochat's Muon use them: one polynomial per iteration, each the minimax-optimal one
    # for the interval the previous left, and the input scaled by 1/1.02 of its norm for
    # the safety factor. Designed for exactly 5 iterations (about [0.87, 1.14]); fewer stop
    # mid-way, where the early polynomials overshoot (docs/recipes.md).
    "polar_express": (1.02, (
        (8.156554524902461, -22.48329292557795, 15.878769915207462),
        (4.042929935166739, -2.808917465908714, 0.5000178451051316),
        (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
        (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
        (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
    )),
}
"""Newton-Schulz coefficient sets by name: (norm scale, one (a, b, c) per iteration; the
last repeats when there are more iterations)."""
NS_STEPS, NS_SET = 5, "jordan"
"""Muon's Newton-Schulz defaults, torch.optim.Muon's: 5 iterations of Jordan's quintic."""


def newton_schulz_dtype(device: torch.device | str) -> torch.dtype:
    """What Newton-Schulz computes in on `device`: bf16 where it computes bf16 natively
    (torch.optim.Muon's choice), float32 elsewhere. On a CPU without bf16 units (AVX2
    alone) a bf16 matmul is emulated: with the AVX2 path forced on a 2-core AMD EPYC
    (ONEDNN_MAX_CPU_ISA=AVX2) it ran at 1 GFLOP/s against 170 in float32, and Muon's
    iterations made the default run's float32 step 4.3 s instead of ~0.5 (issue 48)."""
    return torch.bfloat16 if device_has_bf16(device) else torch.float32


def orthogonalize(updates: torch.Tensor, coefficients: str | tuple = NS_SET, steps: int = NS_STEPS,
                  eps: float = 1e-7) -> torch.Tensor:
    """Newton-Schulz iterations towards U V^T of each matrix's SVD U S V^T, in bf16 (float32
    where the device has no bf16 units: `newton_schulz_dtype`).

    Args:
        updates: (k, rows, cols) same-shape matrices, orthogonalized in one batched call.
        coefficients: a name in NS_COEFFICIENTS, or one (a, b, c) for every iteration
            (torch.optim.Muon's `ns_coefficients`; old checkpoints hold one).
        steps: iterations.
        eps: the least norm divided by.

    Returns:
        (k, rows, cols) in that dtype. With "jordan", 5 steps and bf16, bit for bit
        torch.optim.Muon's result for each matrix (one matmul per matrix of the stack, the
        same order of operations); stacked, a step calls 3 batched matmuls per shape and
        iteration where torch calls 3 per matrix.
    """
    scale, table = (NS_COEFFICIENTS[coefficients] if isinstance(coefficients, str)
                    else (1.0, (tuple(coefficients),)))
    x = updates.to(newton_schulz_dtype(updates.device))
    tall = updates.size(-2) > updates.size(-1)
    if tall:  # the Gram matrix of the shorter side
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) * scale).clamp(min=eps)  # spectral norm <= 1
    for i in range(steps):
        a, b, c = table[min(i, len(table) - 1)]
        gram = x @ x.mT  # (k, short, short)
        gram_update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, gram_update, x, beta=a)
    return x.mT if tall else x


def muon_class() -> type[torch.optim.Optimizer]:
    """`torch.optim.Muon`, or a clear error naming the torch that ships it."""
    muon = getattr(torch.optim, "Muon", None)
    if muon is None:
        raise ValueError(
            f"model.optimizer=muon needs torch.optim.Muon, which torch {MUON_TORCH} first "
            f"ships; this is torch {torch.__version__}: pip install 'torch>={MUON_TORCH}', or "
            "use --model.optimizer adamw")
    return muon


class BatchedMuon(getattr(torch.optim, "Muon", torch.optim.Optimizer)):
    """torch's Muon, with the same-shape matrices orthogonalized in one batched call and
    the Newton-Schulz steps and coefficients per group (`ns_steps`, `ns_coefficients`: a
    name in NS_COEFFICIENTS, or one (a, b, c)). With torch's defaults ("jordan", 5 steps)
    the parameters are torch's Muon's bit for bit, and the state dict has its layout.

    The default run's 28 matrices are 2 shapes (256 x 256, and 256 x 704 with the 704 x 256
    ones transposed): 30 batched matmuls a step where torch calls 420 one by one
    (`bench/speedrun.py --step_cost` prints what each costs).

    Sharded parameters (FSDP2's DTensors, rows split across the ranks of a 1-D mesh) are
    orthogonalized whole: each matrix has one owner rank, which receives the other ranks'
    rows, orthogonalizes the whole matrix and sends each rank its rows of the update back
    (two all-to-alls per shape; `sharded_orthogonalize`). The momentum stays in shards.

    A step whose `found_inf` (a 0-d tensor, set as for fused AdamW) is nonzero changes
    neither the weights nor the momentum, decided on the device: nothing waits for it.
    """

    def __init__(self, params, **kwargs):
        muon_class()  # a torch without Muon: the error that names the release
        super().__init__(params, **kwargs)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = getattr(self, "found_inf", None)
        keep = None if found_inf is None else _local(found_inf) == 0
        for group in self.param_groups:
            self._step_group(group, keep)
        return loss

    def _step_group(self, group: dict, keep: torch.Tensor | None) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        momentum, lr = group["momentum"], group["lr"]
        updates = []
        for p in params:  # torch's momentum, Nesterov or not, on this rank's rows
            buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p.grad))
            grad, buf = _local(p.grad), _local(buf)
            new_buf = buf.lerp(grad, 1 - momentum)
            buf.copy_(new_buf if keep is None else torch.where(keep, new_buf, buf))
            updates.append(grad.lerp(new_buf, momentum) if group["nesterov"] else new_buf)
        if any(isinstance(p, DTensor) for p in params):
            done = sharded_orthogonalize(params, updates, group["ns_coefficients"],
                                         group["ns_steps"], group["eps"])
        else:
            done = _stacked_orthogonalize(updates, group["ns_coefficients"], group["ns_steps"],
                                          group["eps"])
        for p, update in zip(params, done, strict=True):
            weights = _local(p)
            new = weights if keep is None else weights.clone()
            new.mul_(1 - lr * group["weight_decay"])
            new.add_(update, alpha=-_adjusted_lr(lr, group["adjust_lr_fn"], p.shape))
            if keep is not None:
                weights.copy_(torch.where(keep, new, weights))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (its storage: in-place changes are the DTensor's), or
    the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _wide(matrix: torch.Tensor) -> torch.Tensor:
    return matrix.mT if matrix.size(-2) > matrix.size(-1) else matrix


def _stacked_orthogonalize(updates: list[torch.Tensor], coefficients, steps: int,
                           eps: float) -> list[torch.Tensor]:
    """`orthogonalize` of whole matrices, the same wide shapes stacked into one call (a tall
    matrix is orthogonalized as its transpose); each returned in its own orientation."""
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for i, update in enumerate(updates):
        by_shape.setdefault(tuple(_wide(update).shape), []).append(i)
    done: list[torch.Tensor] = [updates[0]] * len(updates)
    for indices in by_shape.values():
        stack = torch.stack([_wide(updates[i]) for i in indices])  # (k, short, long)
        for i, result in zip(indices, orthogonalize(stack, coefficients, steps, eps).unbind(),
                             strict=True):
            done[i] = result.mT if result.shape != updates[i].shape else result
    return done


def sharded_orthogonalize(params: list[torch.Tensor], updates: list[torch.Tensor],
                          coefficients: str | tuple = NS_SET, steps: int = NS_STEPS,
                          eps: float = 1e-7) -> list[torch.Tensor]:
    """`orthogonalize` of whole matrices that FSDP2 shards by rows, each done once.

    The k matrices of one shape get owners in blocks (matrix j: rank j // ceil(k / W) of W
    ranks). One all-to-all brings every owner the rows of its matrices; it orthogonalizes
    them stacked, and a second all-to-all returns every rank its rows of each update. bf16
    both ways (float32 without bf16 units): `orthogonalize` rounds its input so first and
    returns that dtype, so the
    result is the unsharded one (nanochat's and torchtitan's dion Muon do the same rounds
    with reduce-scatter / all-gather around the DDP gradient reduction).

    Args:
        params: DTensors placed Shard(0) on one 1-D mesh (fully_shard's layout).
        updates: this rank's rows of each parameter's update, in `params`' order.

    Returns:
        This rank's rows of each orthogonalized update (`newton_schulz_dtype`), in `params`'
        order.
    """
    mesh = params[0].device_mesh
    if mesh.ndim != 1 or any(not isinstance(p, DTensor) or p.device_mesh != mesh
                             or p.placements != (Shard(0),) for p in params):
        raise ValueError("model.optimizer=muon under sharding needs every matrix sharded by "
                         "rows on one 1-D mesh (fully_shard's layout, --trainer.strategy "
                         "fsdp2); tensor or 2-D parallel layouts are not supported: use "
                         "--model.optimizer adamw")
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for i, p in enumerate(params):
        by_shape.setdefault(tuple(p.shape), []).append(i)
    done: list[torch.Tensor] = [updates[0]] * len(updates)
    for (rows, cols), indices in by_shape.items():
        results = _owners_orthogonalize([updates[i] for i in indices], rows, cols, mesh,
                                        (coefficients, steps, eps))
        for i, result in zip(indices, results, strict=True):
            done[i] = result
    return done


def _owners_orthogonalize(shards: list[torch.Tensor], rows: int, cols: int, mesh,
                          settings: tuple) -> list[torch.Tensor]:
    """The k same-shape matrices whose rows `shards` are: owners orthogonalize, all-to-all
    in and out (see `sharded_orthogonalize`)."""
    world, rank, group = mesh.size(), mesh.get_local_rank(), mesh.get_group()
    per_owner, chunk = -(-len(shards) // world), -(-rows // world)  # ceil: torch.chunk's rows
    # (owner, slot, chunk rows, cols): an owner's slot s is matrix owner * per_owner + s
    outgoing = shards[0].new_zeros(world, per_owner, chunk, cols,
                                   dtype=newton_schulz_dtype(shards[0].device))
    for j, shard in enumerate(shards):
        outgoing[j // per_owner, j % per_owner, :shard.size(0)] = shard
    incoming = torch.empty_like(outgoing)  # (sender, slot, chunk rows, cols)
    torch.distributed.all_to_all_single(incoming, outgoing, group=group)
    whole = incoming.transpose(0, 1).reshape(per_owner, world * chunk, cols)
    owned = max(0, min(per_owner, len(shards) - rank * per_owner))
    if owned:  # the padding rows beyond `rows` are left out, and padding matrices
        mine = whole[:owned, :rows]  # stacked wide, as `_stacked_orthogonalize` stacks them
        result = orthogonalize(_wide(mine).contiguous(), *settings)
        whole[:owned, :rows] = result.mT if result.shape != mine.shape else result
    whole[owned:] = 0
    outgoing = whole.reshape(per_owner, world, chunk, cols).transpose(0, 1).contiguous()
    returned = torch.empty_like(outgoing)  # (owner, slot, ...); `outgoing` may alias incoming
    torch.distributed.all_to_all_single(returned, outgoing, group=group)
    return [returned[j // per_owner, j % per_owner, :shard.size(0)]
            for j, shard in enumerate(shards)]


def _adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """torch Muon's per-shape rate (torch.optim._muon._adjust_lr, private there)."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr


class MuonAdamW(torch.optim.Optimizer):
    """torch's Muon (batched: `BatchedMuon`) on the hidden matrices and fused AdamW on the
    rest, as one optimizer.

    Lightning's automatic optimization steps one optimizer; as one, the warmup/cosine
    scheduler (each group keeps its own base rate), gradient clipping, accumulation,
    checkpoints and the non-finite skip work as they do for AdamW. The param groups are
    AdamW's (decayed, plain) then Muon's, shared with the two inner optimizers, as is the
    state, so `state_dict` has the usual layout. A nonzero `found_inf` (0-d, set before
    `step` as for fused AdamW) skips the whole step on the device, nothing waiting for it
    (a GPU sync each step cost the default run its overlap: tests/test_gpu.py).
    """

    def __init__(self, adamw_groups: list[dict], muon_params: list[nn.Parameter], *,
                 learning_rate: float, muon_learning_rate: float, weight_decay: float,
                 betas: tuple[float, float], fused: bool, ns_steps: int = NS_STEPS,
                 ns_coefficients: str = NS_SET, batched: bool = True):
        self.adamw = torch.optim.AdamW(adamw_groups, lr=learning_rate, betas=betas,
                                       fused=fused)
        if batched:
            self.muon = BatchedMuon(muon_params, lr=muon_learning_rate,
                                    weight_decay=weight_decay, adjust_lr_fn=MUON_ADJUST_LR,
                                    ns_steps=ns_steps, ns_coefficients=ns_coefficients)
        else:  # torch's own, one matrix at a time (the reference bench/speedrun.py times)
            self.muon = muon_class()(muon_params, lr=muon_learning_rate,
                                     weight_decay=weight_decay, adjust_lr_fn=MUON_ADJUST_LR,
                                     ns_steps=ns_steps,
                                     ns_coefficients=NS_COEFFICIENTS[ns_coefficients][1][0])
        super().__init__([*self.adamw.param_groups, *self.muon.param_groups], {})
        self._share()

    def _share(self) -> None:
        """The inner optimizers see this one's groups (the scheduler's rates) and state."""
        n = len(self.adamw.param_groups)
        self.adamw.param_groups, self.muon.param_groups = (self.param_groups[:n],
                                                           self.param_groups[n:])
        self.adamw.state = self.muon.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)  # new group dicts and state: share them again
        self._share()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and not self.skips_on_device:  # torch's own Muon, or mps
            if bool(found_inf):
                return loss
            found_inf = None
        self.adamw.found_inf = self.muon.found_inf = found_inf
        self.adamw.step()
        self.muon.step()
        return loss

    @property
    def skips_on_device(self) -> bool:
        """Whether a nonzero `found_inf` skips the step without the host waiting: with fused
        AdamW and `BatchedMuon`."""
        return bool(self.adamw.defaults.get("fused")) and isinstance(self.muon, BatchedMuon)


def muon_adamw(model: nn.Module, *, learning_rate: float, muon_learning_rate: float,
               weight_decay: float, betas: tuple[float, float], device: torch.device,
               ns_steps: int = NS_STEPS, ns_coefficients: str = NS_SET,
               batched: bool = True) -> MuonAdamW:
    """Muon for the 2-D weights inside `model.trf_blocks` (attention and MLP projections);
    AdamW for the embeddings and head (decayed) and the biases and norm gains (not).
    `ns_steps` Newton-Schulz iterations with the NS_COEFFICIENTS set `ns_coefficients`;
    `batched` False: torch's Muon itself, one matrix at a time (only "jordan")."""
    if not batched and ns_coefficients != "jordan":
        raise ValueError("torch's Muon takes one (a, b, c) for every iteration: use "
                         "ns_coefficients='jordan' with batched=False")
    hidden = [p for p in model.trf_blocks.parameters() if p.requires_grad and p.dim() == 2]
    ids = {id(p) for p in hidden}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in ids]
    groups = [{"params": [p for p in rest if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0}]
    return MuonAdamW(groups, hidden, learning_rate=learning_rate,
                     muon_learning_rate=muon_learning_rate, weight_decay=weight_decay,
                     betas=betas, fused=device.type in ("cuda", "cpu"), ns_steps=ns_steps,
                     ns_coefficients=ns_coefficients, batched=batched)


def check_muon_settings(ns_steps: int, ns_coefficients: str) -> None:
    """Raise a ValueError naming the field unless Newton-Schulz can run with these."""
    if not isinstance(ns_steps, int) or not 1 <= ns_steps <= 20:
        raise ValueError(f"model.muon_ns_steps={ns_steps!r}: use an integer from 1 to 20 "
                         "(5 is torch's default)")
    if ns_coefficients not in NS_COEFFICIENTS:
        raise ValueError(f"model.muon_ns_coefficients={ns_coefficients!r}: use one of "
                         f"{', '.join(NS_COEFFICIENTS)}")


def is_muon_group(group: dict) -> bool:
    """A saved parameter group of Muon's: it carries the Newton-Schulz settings."""
    return "ns_steps" in group
