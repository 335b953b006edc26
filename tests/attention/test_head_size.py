"""A head size of its own and a score scale of its own (issue 45 item 1; Qwen3-0.6B's 128
for a width of 1024 and 16 heads, Gemma's query_pre_attn_scalar): the book's module keeps
its signature, and with the extras computes what per-head attention written out computes."""

import math

import pytest
import torch

from gptmini.attention import MultiHeadAttention
from gptmini.model import ConfigError, GPTConfig, GPTModel


def written_out(module: MultiHeadAttention, x: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention head by head from the module's weights, in float64: each query
    head h reads key/value head h // (heads / kv_heads), scores times `scale`."""
    heads, kv_heads, size = module.num_heads, module.num_kv_heads, module.head_dim
    q = (x @ module.W_query.weight.T).unflatten(-1, (heads, size))  # (b, n, heads, size)
    k = (x @ module.W_key.weight.T).unflatten(-1, (kv_heads, size))
    v = (x @ module.W_value.weight.T).unflatten(-1, (kv_heads, size))
    n = x.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    outs = []
    for h in range(heads):
        g = h // (heads // kv_heads)
        scores = (q[:, :, h] @ k[:, :, g].transpose(1, 2)) * scale  # (b, n, n)
        weights = scores.masked_fill(~causal, -math.inf).softmax(-1)
        outs.append(weights @ v[:, :, g])  # (b, n, size)
    return torch.cat(outs, dim=-1) @ module.out_proj.weight.T + module.out_proj.bias


def test_the_book_signature_and_default_are_unchanged():
    torch.manual_seed(123)
    book = MultiHeadAttention(3, 2, 6, 0.0, 2)  # Listing 3.5's call, positionally
    assert (book.head_dim, book.W_query.weight.shape, book.out_proj.weight.shape) == (
        1, (2, 3), (2, 2))
    with pytest.raises(TypeError):
        MultiHeadAttention(3, 2, 6, 0.0, 2, False, None, None, True, "sdpa", None, None,
                           False, False, True, None, False, "none", 4)  # keyword-only extras


@pytest.mark.parametrize("backend", ["sdpa", "explicit"])
@pytest.mark.parametrize(("head_dim", "scale"), [(None, None), (12, None), (12, 0.2),
                                                 (None, 24 ** -0.5)])
def test_heads_of_their_own_size_and_scale_compute_per_head_attention(backend, head_dim,
                                                                      scale):
    torch.manual_seed(0)
    module = MultiHeadAttention(16, 16, 32, 0.0, 4, num_kv_heads=2, head_dim=head_dim,
                                scale=scale, backend=backend).double().eval()
    inner = 4 * (head_dim or 4)
    assert module.W_query.weight.shape == (inner, 16)
    assert module.W_key.weight.shape == (2 * (head_dim or 4), 16)
    assert module.out_proj.weight.shape == (16, inner)
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    want = written_out(module, x, scale or module.head_dim ** -0.5)
    torch.testing.assert_close(module(x), want)


def test_a_config_gives_the_heads_their_size_and_names_a_bad_one():
    cfg = GPTConfig(vocab_size=64, context_length=16, emb_dim=24, n_heads=5, n_kv_heads=1,
                    head_dim=8, n_layers=1, position="rope")  # 5 heads do not divide 24
    att = GPTModel(cfg).trf_blocks[0].att
    assert (cfg.head_size, att.head_dim, att.W_query.weight.shape) == (8, 8, (40, 24))
    assert GPTConfig(emb_dim=64, n_heads=4).head_size == 16  # the book's: width / heads
    for value, match in ((0, "head_dim=0 is invalid: use a positive integer"),
                         (7, "head_dim=7 is invalid: rotary positions turn dimensions in "
                             "pairs")):
        with pytest.raises(ConfigError, match=match):
            GPTConfig(emb_dim=24, n_heads=5, head_dim=value, position="rope")
    with pytest.raises(ConfigError, match="n_heads=5 is invalid: it must divide the width "
                                          r"\(24\).*or give the heads a head_dim"):
        GPTConfig(emb_dim=24, n_heads=5)
    with pytest.raises(ValueError, match="scale=0 is invalid"):
        MultiHeadAttention(8, 8, 4, 0.0, 2, scale=0)
