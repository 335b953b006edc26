"""Kernels as a table: the README's example backend, registered from outside the package,
runs everywhere a built-in one does and equals the explicit path."""

import functools
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from gptmini.attention import KVCache, MultiHeadAttention, kernels
from gptmini.model import GPTConfig, GPTModel
from gptmini.testing import AttentionSpec, check_attention

README = Path(__file__).resolve().parents[2] / "docs" / "attention.md"


@pytest.fixture
def readme_kernel():
    """Run the README's example backend as a reader would; the registry is restored after."""
    saved = dict(kernels.KERNELS)
    text = README.read_text()
    section = text[text.index("**Kernels are a table.**"):]
    code = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    printed = []
    exec(compile(code, "README.md", "exec"),
         {"__name__": "readme", "print": lambda *a: printed.append(" ".join(map(str, a)))})
    assert printed == ["torch.Size([2, 5, 8])"]
    yield "float64"
    kernels.KERNELS.clear()
    kernels.KERNELS.update(saved)


@pytest.mark.parametrize("kv_heads", [None, 1])
def test_a_registered_kernel_equals_the_explicit_path_with_padding_windows_and_gqa(
        readme_kernel, kv_heads):
    def make(backend):
        torch.manual_seed(0)
        return MultiHeadAttention(8, 8, 16, 0.0, 2, num_kv_heads=kv_heads, window_size=4,
                                  backend=backend)

    x = torch.randn(2, 9, 8)
    real = torch.ones(2, 9, dtype=torch.long)
    real[0, :3] = 0  # left padding: queries with no key at all
    got, want = make(readme_kernel)(x, real), make("explicit")(x, real)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert (got[0, :3] == 0).all()


def test_a_registered_kernel_builds_a_model_that_trains_and_decodes(readme_kernel, tiny_config):
    model = GPTModel(replace(tiny_config, attention_backend=readme_kernel))
    assert all(block.att.backend == "float64" for block in model.trf_blocks)
    idx = torch.randint(0, 64, (2, 12))
    loss = model(idx[:, :-1], targets=idx[:, 1:])
    loss.backward()
    assert model.tok_emb.weight.grad.abs().sum() > 0
    model.eval()
    caches = model.new_kv_caches()
    with torch.no_grad():
        steps = [model(idx[:, :6], kv_caches=caches)]
        steps += [model(idx[:, t:t + 1], kv_caches=caches) for t in range(6, 12)]
        torch.testing.assert_close(torch.cat(steps, 1), model(idx), atol=1e-5, rtol=1e-5)


def test_the_conformance_kit_passes_a_registered_kernel(readme_kernel):
    def kv_step(module, x_new, cache):
        cache = cache or KVCache()
        return module(x_new, kv_cache=cache), cache

    spec = AttentionSpec(padding="attention_mask", padding_marks="real", window=4,
                         kv_step=kv_step)
    report = check_attention(functools.partial(MultiHeadAttention, backend=readme_kernel), spec)
    assert report.passed, str(report)


def test_unknown_and_malformed_kernels_are_named():
    with pytest.raises(ValueError, match="backend must be one of sdpa, explicit, flex, tiled"):
        kernels.make_kernel("fast")
    with pytest.raises(ValueError, match="a kernel's name must be a non-empty string"):
        kernels.register("", object)
    with pytest.raises(ValueError, match="GPTConfig.attention_backend='fast' is invalid"):
        GPTConfig(attention_backend="fast")
