"""RMSNorm with torch's exact result at about LayerNorm's speed on a CPU.

`nn.RMSNorm` on a CPU runs a fused forward but has no fused backward (torch 2.13 ships
`_fused_rms_norm_backward` for no CPU): autograd differentiates the composite formula, a
dozen passes over the activations, and under bf16 autocast the float32 gain makes even the
forward composite (with a "Mismatch dtype ... Cannot dispatch to fused implementation"
warning on every run). Measured on a 2-core Xeon with AMX shared with other jobs, forward
and backward of 1,024 x 256, 1 thread: F.rms_norm 1.7-2.3 ms, this one 0.7-1.4 ms,
nn.LayerNorm 0.35-0.6 ms (bench/bench_norms.py prints today's, side by side).

`RMSNorm` here is `nn.RMSNorm` (the same `weight`, the same checkpoints) whose CPU forward
and backward are written by hand in float32 (float64 stays float64) and reach a fused
kernel where one exists: the squared norm is one `linalg.vector_norm` pass, and the
backward is LayerNorm's own fused backward kernel, which for a mean of 0 is RMSNorm's
gradient but for one term, added back here:

    LayerNorm's dx, mean 0:  rstd * (g*w - mean(g*w) - xhat * mean(g*w * xhat))
    RMSNorm's dx:            rstd * (g*w            - xhat * mean(g*w * xhat))

where xhat = x * rstd and rstd = 1 / sqrt(mean(x^2) + eps); the gain's gradient,
sum(g * xhat), is the same for both. Like torch's, the result is computed in float32 and
rounded once to the input's dtype. Inside torch.compile it is the formula, which inductor
fuses into one kernel; on other devices, `nn.RMSNorm`'s forward.
"""

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

__all__ = ["RMS_NORMS", "RMSNorm", "ZeroCenteredRMSNorm", "rms_norm"]


class _RMSNormFunction(torch.autograd.Function):
    """y = x * rstd * w over the last dimension, computed in float32 (or float64)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float | None) -> Tensor:
        # Under autocast as outside it: the norm is computed in float32 and the backward's
        # matrix-vector product must not drop to bf16.
        with torch.autocast(x.device.type, enabled=False):
            wide = torch.promote_types(x.dtype, torch.float32)  # float64 stays float64
            eps = torch.finfo(wide).eps if eps is None else eps  # torch's default, as torch
            xf = x.to(wide).contiguous()  # LayerNorm's backward reads rows in memory order
            norm = torch.linalg.vector_norm(xf, dim=-1, keepdim=True)  # (..., 1)
            rstd = torch.rsqrt(norm.square_().div_(x.shape[-1]).add_(eps))  # (..., 1)
            ctx.save_for_backward(xf, weight, rstd)
            ctx.input_dtype = x.dtype
            return torch.mul(xf, rstd).mul_(weight.to(wide)).to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        xf, weight, rstd = ctx.saved_tensors
        with torch.autocast(xf.device.type, enabled=False):
            gf = grad.to(xf.dtype).contiguous()
            wf = weight.to(xf.dtype)
            dx, dw, _ = torch.ops.aten.native_layer_norm_backward(
                gf, xf, [xf.shape[-1]], torch.zeros_like(rstd), rstd, wf, None,
                [ctx.needs_input_grad[0], ctx.needs_input_grad[1], False])
            if dx is not None:  # LayerNorm's mean term, which RMSNorm has not, added back
                mean_gw = (gf @ wf).unsqueeze(-1).div_(xf.shape[-1])  # (..., 1)
                dx = dx.addcmul_(rstd, mean_gw).to(ctx.input_dtype)
            return dx, None if dw is None else dw.to(weight.dtype), None


def rms_norm(x: Tensor, weight: Tensor, eps: float | None = None) -> Tensor:
    """`F.rms_norm(x, (x.shape[-1],), weight, eps)`, fast on a CPU (see the module).

    Args:
        x: (..., dim), any float dtype.
        weight: (dim,) the gain.
        eps: added to the mean square; None: the float32 (or float64) epsilon, as torch.

    Returns:
        (..., dim) in x's dtype, whatever the weight's (as torch's).
    """
    if torch.compiler.is_compiling():  # the formula, which inductor fuses (no warning)
        wide = torch.promote_types(x.dtype, torch.float32)
        eps = torch.finfo(wide).eps if eps is None else eps
        xf = x.to(wide)
        rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
        return (xf * rstd * weight.to(wide)).to(x.dtype)
    if x.device.type != "cpu":
        return nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
    return _RMSNormFunction.apply(x, weight, eps)


class RMSNorm(nn.RMSNorm):
    """`nn.RMSNorm` over the last dimension (its parameter `weight`, its checkpoints),
    computed by `rms_norm` where it has a gain; without one, torch's own."""

    def forward(self, x: Tensor) -> Tensor:
        if self.weight is None or len(self.normalized_shape) != 1:
            return super().forward(x)
        return rms_norm(x, self.weight, self.eps)


class ZeroCenteredRMSNorm(RMSNorm):
    """RMSNorm whose gain is 1 + weight, the weight starting at 0 (Gemma's: its checkpoints
    store the weight, and weight decay pulls the gain toward 1, not 0). The gain is formed
    in float32 or wider, as Gemma's is, so a bf16 weight near 0 keeps its digits."""

    def reset_parameters(self) -> None:  # (nn.RMSNorm's constructor calls it)
        super().reset_parameters()
        if self.weight is not None:
            nn.init.zeros_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        wide = torch.promote_types(self.weight.dtype, torch.float32)
        return rms_norm(x, 1.0 + self.weight.to(wide), self.eps)


RMS_NORMS = {"rmsnorm": RMSNorm, "rmsnorm1p": ZeroCenteredRMSNorm}
"""The RMS norms by GPTConfig.norm's name: Llama's and Gemma's (gain 1 + weight)."""
