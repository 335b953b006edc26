"""gptmini's RMSNorm gives torch's RMSNorm's result, forward and backward, in every dtype,
and keeps its parameters (checkpoints load unchanged)."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gptmini.attention.norm import RMSNorm, rms_norm
from gptmini.model import GPTConfig, GPTModel, lm_loss


def explicit_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The formula, written out (the oracle beside torch's own)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def forward_backward(norm, x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor):
    """(output, grad of x, grad of weight) of norm(x, weight)."""
    x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
    y = norm(x, weight)
    y.backward(grad)
    return y.detach(), x.grad, weight.grad


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-12), (torch.float32, 2e-6)])
@pytest.mark.parametrize("shape", [(6, 32), (2, 5, 3, 16)])
@pytest.mark.parametrize("eps", [1e-6, None])
def test_equals_torch_and_the_formula_forward_and_backward(dtype, tol, shape, eps):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype) * 3
    weight = torch.randn(shape[-1], generator=gen, dtype=torch.float64).to(dtype)
    grad = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    ours = forward_backward(lambda x, w: rms_norm(x, w, eps), x, weight, grad)
    theirs = forward_backward(lambda x, w: F.rms_norm(x, (shape[-1],), w, eps), x, weight, grad)
    formula_eps = torch.finfo(dtype).eps if eps is None else eps
    formula = forward_backward(lambda x, w: explicit_rms_norm(x, w, formula_eps), x, weight,
                               grad)
    for name, a, b, c in zip(("output", "x grad", "weight grad"), ours, theirs, formula,
                             strict=True):
        assert a.dtype == b.dtype == dtype, name
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=name)
        torch.testing.assert_close(a, c, rtol=tol, atol=tol, msg=name)


def test_gradients_match_finite_differences():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(8, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: rms_norm(x, w, 1e-6), (x, weight))


def test_a_non_contiguous_input_is_normalized_per_row():
    """QK-norm may see a transposed view; LayerNorm's backward reads rows in memory order."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 6, 3, 16, generator=gen, dtype=torch.float64).transpose(1, 2)
    weight, grad = torch.randn(16, dtype=torch.float64), torch.randn(2, 3, 6, 16,
                                                                     dtype=torch.float64)
    ours = forward_backward(lambda x, w: rms_norm(x, w, 1e-6), x, weight, grad)
    theirs = forward_backward(lambda x, w: F.rms_norm(x, (16,), w, 1e-6), x, weight, grad)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_under_bf16_autocast_it_rounds_once_as_torch(weight_dtype):
    """A bf16 activation (a matmul's output under autocast) and a float32 gain: computed in
    float32 and rounded once to bf16, as torch's; at most one bf16 step apart (the sums
    are taken in another order), and the gradients in the input's and gain's dtypes."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 128, generator=gen).to(torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(128, generator=gen)).to(weight_dtype)
    grad = torch.randn(64, 128, generator=gen).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = forward_backward(lambda x, w: rms_norm(x, w, 1e-6), x, weight, grad)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own "Mismatch dtype" warning
        with torch.autocast("cpu", dtype=torch.bfloat16):
            theirs = forward_backward(lambda x, w: F.rms_norm(x, (128,), w, 1e-6), x, weight,
                                      grad)
    for name, a, b in zip(("output", "x grad", "weight grad"), ours, theirs, strict=True):
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a.float(), b.float(), rtol=2**-7, atol=1e-3, msg=name)
    assert (ours[0] == theirs[0]).float().mean() > 0.99  # nearly all bit for bit


def test_the_default_model_under_bf16_autocast_emits_no_warning():
    """torch's RMSNorm warns "Mismatch dtype ... Cannot dispatch to fused implementation"
    on every bf16 run (a bf16 input, a float32 gain); the model's norms do not."""
    cfg = GPTConfig(vocab_size=64, context_length=16, emb_dim=32, n_heads=2, n_layers=2,
                    position="rope", norm="rmsnorm", mlp="swiglu", qk_norm=True, bias=False)
    model = GPTModel(cfg)
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = lm_loss(model, idx, idx)
        loss.backward()
    norms = [m for m in model.modules() if isinstance(m, nn.RMSNorm)]
    assert len(norms) == 2 * 2 + 2 * 2 + 1  # the blocks', the QK-norms', the final
    assert all(isinstance(m, RMSNorm) for m in norms)


def test_parameters_and_checkpoints_are_torch_rmsnorms():
    ours, theirs = RMSNorm(16, eps=1e-6), nn.RMSNorm(16, eps=1e-6)
    assert list(ours.state_dict()) == list(theirs.state_dict()) == ["weight"]
    theirs.weight.data.uniform_()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(3, 16)
    torch.testing.assert_close(ours(x), theirs(x))


def test_without_a_gain_it_is_torchs():
    x = torch.randn(3, 16)
    torch.testing.assert_close(RMSNorm(16, elementwise_affine=False)(x),
                               F.rms_norm(x, (16,)))


@pytest.mark.slow
def test_under_torch_compile_it_is_torchs_result():
    """Inside a compiled graph the norm is the formula, which inductor fuses."""
    gen = torch.Generator().manual_seed(4)
    norm = RMSNorm(16, eps=1e-6)
    norm.weight.data.uniform_(0.5, 1.5, generator=gen)
    x = torch.randn(4, 16, generator=gen, requires_grad=True)
    compiled = torch.compile(norm, backend="aot_eager", fullgraph=True)
    y = compiled(x)
    y.sum().backward()
    eager_x = x.detach().requires_grad_()
    F.rms_norm(eager_x, (16,), norm.weight.detach(), 1e-6).sum().backward()
    torch.testing.assert_close(y, F.rms_norm(x, (16,), norm.weight, 1e-6))
    torch.testing.assert_close(x.grad, eager_x.grad)
