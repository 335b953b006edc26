"""Position schemes and the modern block options: rotary embeddings against an independent
complex-number rotation, ALiBi slopes against the paper, and every option through every
backend, the KV cache, padding, documents and the engine."""

import json
import math
from dataclasses import replace

import pytest
import torch

from gptmini.attention import MultiHeadAttention
from gptmini.attention.positions import (
    SCHEMES,
    RotaryPositions,
    alibi_slopes,
    apply_rope,
    rope_angles,
)
from gptmini.generate.engine import Engine
from gptmini.generate.loop import generate, left_pad
from gptmini.model import ConfigError, GPTConfig, GPTModel, lm_loss


def rope_by_complex_numbers(x: torch.Tensor, positions: list[int], theta: float) -> torch.Tensor:
    """Dimension i and i + d/2 as one complex number, multiplied by e^(i * p * w_i)."""
    d = x.shape[-1]
    z = torch.complex(x[..., : d // 2], x[..., d // 2:])  # (..., n, d/2)
    w = torch.tensor([theta ** (-2 * i / d) for i in range(d // 2)], dtype=torch.float64)
    p = torch.tensor(positions, dtype=torch.float64)[:, None]
    turned = z * torch.polar(torch.ones_like(p * w), p * w)
    return torch.cat([turned.real, turned.imag], dim=-1)


def test_rope_is_a_rotation_by_position_times_frequency():
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64)
    positions = [0, 1, 7, 20, 3]
    cos, sin = rope_angles(torch.tensor([positions] * 2), 8, theta=500.0, dtype=torch.float64)
    torch.testing.assert_close(apply_rope(x, cos, sin),
                               rope_by_complex_numbers(x, positions, 500.0))


def test_rotated_scores_depend_only_on_the_distance():
    q, k = torch.randn(1, 1, 1, 16, dtype=torch.float64), torch.randn(1, 1, 1, 16,
                                                                      dtype=torch.float64)

    def score(pq, pk):
        qa = rope_angles(torch.tensor([[pq]]), 16, dtype=torch.float64)
        ka = rope_angles(torch.tensor([[pk]]), 16, dtype=torch.float64)
        return float((apply_rope(q, *qa) * apply_rope(k, *ka)).sum())

    assert score(9, 4) == pytest.approx(score(109, 104), rel=1e-10)
    assert score(9, 4) != pytest.approx(score(9, 3), rel=1e-6)


@pytest.mark.parametrize("heads", [8, 12])
def test_alibi_slopes_follow_the_paper(heads):
    # 8 heads: 1/2, 1/4, ..., 1/256. 12: the 8 of 8 heads, then every other one of 16 heads
    # (2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5), as the paper's code builds non-powers of two.
    eight = [2.0 ** -(i + 1) for i in range(8)]
    expected = eight if heads == 8 else eight + [2.0 ** -(0.5 + i) for i in range(4)]
    torch.testing.assert_close(alibi_slopes(heads).double(), torch.tensor(expected,
                                                                          dtype=torch.float64))


def modern(tiny_config, **fields):
    options = {"position": "rope", "norm": "rmsnorm", "mlp": "swiglu", "qk_norm": True,
               "bias": False, "tie_weights": False, **fields}
    return replace(tiny_config, **options)


@pytest.mark.parametrize(("position", "softcap"), [("rope", None), ("none", None),
                                                    ("learned", None), ("alibi", 30.0)])
def test_the_kv_cache_equals_recomputing_for_every_position_scheme(tiny_config, position,
                                                                     softcap):
    model = GPTModel(modern(tiny_config, position=position, attn_softcap=softcap))
    model = model.double().eval()
    idx = torch.randint(0, 64, (2, 20))
    caches = model.new_kv_caches()
    with torch.no_grad():
        steps = [model(idx[:, :7], kv_caches=caches)]
        steps += [model(idx[:, t:t + 1], kv_caches=caches) for t in range(7, 20)]
        torch.testing.assert_close(torch.cat(steps, 1), model(idx))


def test_rotary_padding_and_documents_see_positions_of_their_own(tiny_config):
    model = GPTModel(modern(tiny_config)).double().eval()
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    idx, mask = left_pad(prompts)
    with torch.no_grad():
        padded = model(idx, mask)
        alone = model(torch.tensor([prompts[1]]))
        torch.testing.assert_close(padded[1, -3:], alone[0])
        packed = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
        both = model(packed, document_ids=torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]]))
        torch.testing.assert_close(both[0, 3:], model(packed[:, 3:])[0])


def test_the_engine_decodes_a_rotary_model_as_generate_does(tiny_config):
    model = GPTModel(modern(tiny_config, n_kv_heads=1, window_size=8)).double().eval()
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]]
    engine = Engine(model, max_batch=2, block_size=4)
    got = [r.tokens for r in engine.generate(prompts, max_new_tokens=40)]
    for prompt, tokens in zip(prompts, got, strict=True):
        want = generate(model, torch.tensor([prompt]), 40, use_cache=True)[0, len(prompt):]
        assert tokens == want.tolist()


@pytest.mark.parametrize("backend", ["sdpa", "explicit", "tiled"])
@pytest.mark.parametrize("options", [
    {"position": "rope", "norm": "rmsnorm", "mlp": "swiglu", "qk_norm": True, "bias": False},
    {"position": "none", "mlp": "relu2", "norm": "layernorm", "bias": False},
])
def test_every_option_trains_on_cpu(tiny_config, backend, options):
    cfg = replace(tiny_config, attention_backend=backend, tie_weights=False, **options)
    model = GPTModel(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    idx = torch.randint(0, 64, (4, 17))
    losses = []
    for _ in range(25):
        loss = lm_loss(model, idx[:, :-1], idx[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert math.isfinite(losses[-1]) and losses[-1] < 0.8 * losses[0]  # it learns the batch


def test_parameter_counts_of_the_options(tiny_config):
    def count(**fields):
        return sum(p.numel() for p in GPTModel(replace(tiny_config, **fields)).parameters())

    base = count()
    assert base - count(position="rope") == tiny_config.context_length * tiny_config.emb_dim
    ff = 2 * tiny_config.emb_dim * 4 * tiny_config.emb_dim  # 4x GELU's two matrices
    swiglu = 3 * tiny_config.emb_dim * GPTConfig(**{**tiny_config.to_dict(),
                                                    "mlp": "swiglu"}).hidden_dim
    assert count(mlp="swiglu", bias=False) - count(bias=False) == 2 * (swiglu - ff)
    assert count(qk_norm=True) - base == 2 * 2 * (tiny_config.emb_dim // tiny_config.n_heads)


@pytest.mark.parametrize(("fields", "match"), [
    ({"position": "sinusoidal"}, "position='sinusoidal' is invalid: use one of learned, rope"),
    ({"norm": "batchnorm"}, "use one of layernorm, rmsnorm"),
    ({"mlp": "reglu"}, "use one of gelu, swiglu, relu2, geglu"),
    ({"position": "rope", "emb_dim": 18, "n_heads": 2}, "odd"),
    ({"attn_softcap": 0}, "positive cap"),
])
def test_bad_options_are_named(tiny_config, fields, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(**{**tiny_config.to_dict(), **fields})


def loop_attention(q, k, v, slopes, cap, window):
    """softmax over each query's allowed keys, one (b, h, i, j) at a time: ALiBi's penalty
    and the soft-cap written out, causal with a window, in float64."""
    b, h, n, d = q.shape
    out = torch.zeros_like(q)
    for bi in range(b):
        for hi in range(h):
            for i in range(n):
                keys = [j for j in range(n) if j <= i and i - j < window]
                scores = []
                for j in keys:
                    s = float(q[bi, hi, i] @ k[bi, hi, j]) / math.sqrt(d)
                    if slopes is not None:
                        s += float(slopes[hi]) * (j - i)
                    if cap is not None:
                        s = cap * math.tanh(s / cap)
                    scores.append(s)
                weights = torch.softmax(torch.tensor(scores, dtype=torch.float64), dim=0)
                out[bi, hi, i] = sum(w * v[bi, hi, j] for w, j in zip(weights, keys,
                                                                      strict=True))
    return out


MODIFIERS = {"alibi": {"alibi": True}, "softcap": {"softcap": 0.9},
             "alibi+softcap": {"alibi": True, "softcap": 1.5}}
OPTIONS = {  # MultiHeadAttention options the equality test runs on every backend
    "rope+qk_norm": {"rope_theta": 100.0, "qk_norm": True},
    "rope+mqa": {"rope_theta": 100.0, "num_kv_heads": 1},
    **{name: {**options, "num_kv_heads": 2} for name, options in MODIFIERS.items()},
}


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("backend", ["sdpa", "flex", "tiled"])
def test_every_option_is_equal_on_every_backend_outputs_and_gradients(backend, option):
    """Rotary, QK-norm and the score modifiers, with padding, documents, a window and
    grouped-query attention, against the explicit path (flex: forward only on CPU)."""
    def make(name):
        torch.manual_seed(0)
        mha = MultiHeadAttention(16, 16, 64, 0.0, num_heads=4, window_size=7, backend=name,
                                 **OPTIONS[option])
        if name == "tiled":
            mha.kernel.tile = 4
        return mha

    x = torch.randn(2, 13, 16, requires_grad=backend != "flex")
    real = torch.ones(2, 13, dtype=torch.long)
    real[1, :3] = 0
    documents = torch.tensor([[0] * 9 + [1] * 4, [0] * 13])
    reference = make("explicit")
    want = reference(x, real, document_ids=documents)
    other = make(backend)
    with torch.set_grad_enabled(backend != "flex"):
        got = other(x, real, document_ids=documents)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if backend == "flex":
        return
    grad = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad(got, [x, *other.parameters()], grad),
                    torch.autograd.grad(want, [x, *reference.parameters()], grad), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("modifier", MODIFIERS)
@pytest.mark.parametrize("backend", ["explicit", "sdpa", "tiled"])
def test_score_modifiers_match_the_loop_oracle(backend, modifier):
    options = MODIFIERS[modifier]
    torch.manual_seed(1)
    mha = MultiHeadAttention(8, 8, 32, 0.0, num_heads=2, window_size=5, backend=backend,
                             **options).double()
    if backend == "tiled":
        mha.kernel.tile = 3
    x = torch.randn(2, 9, 8, dtype=torch.float64)
    q = mha.W_query(x).view(2, 9, 2, 4).transpose(1, 2)
    k = mha.W_key(x).view(2, 9, 2, 4).transpose(1, 2)
    v = mha.W_value(x).view(2, 9, 2, 4).transpose(1, 2)
    slopes = alibi_slopes(2) if options.get("alibi") else None
    heads = loop_attention(q, k, v, slopes, options.get("softcap"), 5)
    want = mha.out_proj(heads.transpose(1, 2).reshape(2, 9, 8))
    with torch.no_grad():
        torch.testing.assert_close(mha(x), want)


def test_the_engine_decodes_an_alibi_model_as_generate_does(tiny_config):
    model = GPTModel(replace(tiny_config, position="alibi", attn_softcap=30.0)).double().eval()
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    got = [r.tokens for r in Engine(model, block_size=4).generate(prompts, max_new_tokens=12)]
    for prompt, tokens in zip(prompts, got, strict=True):
        assert tokens == generate(model, torch.tensor([prompt]), 12)[0, len(prompt):].tolist()


def test_a_modern_model_is_not_exported_to_gpt2s_layout(tiny_config, tmp_path):
    from gptmini.convert import export_hf

    model = GPTModel(modern(tiny_config, mlp="relu2"))
    with pytest.raises(ValueError, match="position='rope', norm='rmsnorm', mlp='relu2', "
                                         "qk_norm=True, bias=False.*book's options"):
        export_hf(model, tmp_path / "hf")
    with pytest.raises(ValueError, match="Qwen3's layout.*this model has norm_eps=1e-05"):
        export_hf(GPTModel(modern(tiny_config)), tmp_path / "qwen3")  # QK-norm: Qwen3's eps
    with pytest.raises(ValueError, match="Llama's layout.*this model has attn_softcap=30"):
        export_hf(GPTModel(modern(tiny_config, attn_softcap=30.0)), tmp_path / "llama")


DECAY = '''"""A scheme of a test's: every head's scores fall by `slope` per position of distance."""

from dataclasses import dataclass

from gptmini.attention.positions.base import PositionScheme


@dataclass(frozen=True)
class DecayPositions(PositionScheme):
    slope: float = 0.5

    def score_mod(self, device):
        def decay(score, b, h, q_idx, kv_idx):
            return score + self.slope * (kv_idx - q_idx)

        decay.additive = True
        return decay
'''

TRAIN_AND_GENERATE = '''
import json
from dataclasses import replace

import torch

from gptmini.generate.loop import generate
from gptmini.model import GPTConfig, GPTModel
from gptmini.model.flops import num_parameters
from gptmini.model import lm_loss

cfg = GPTConfig(vocab_size=64, context_length=12, emb_dim=16, n_heads=2, n_layers=2,
                drop_rate=0.0, position="decay")
torch.manual_seed(0)
model = GPTModel(cfg)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
idx = torch.randint(0, 64, (4, 13))
losses = []
for _ in range(20):
    loss = lm_loss(model, idx[:, :-1], idx[:, 1:])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
model.eval()
plain = GPTModel(replace(cfg, position="none")).eval()
plain.load_state_dict(model.state_dict())
# relative, so generation may roll its cache past the context: the same tokens as a model
# whose context holds them all, attending through a window of the first one's context
oracle = GPTModel(replace(cfg, context_length=64, window_size=12)).eval()
oracle.load_state_dict(model.state_dict())
prompt = torch.tensor([[5, 9, 2]])
try:
    GPTConfig(position="sinusoidal")
except ValueError as err:
    named = str(err)
print(json.dumps({
    "losses": [losses[0], losses[-1]],
    "applied": float((model(idx[:, :12]) - plain(idx[:, :12])).abs().max()),
    "rolled": generate(model, prompt, 30, use_cache=True, slide="roll")[0].tolist(),
    "window": generate(oracle, prompt, 30)[0].tolist(),
    "embedding_parameters": num_parameters(model) - num_parameters(model, non_embedding=True),
    "named": named,
}))
'''


def test_a_new_position_scheme_is_one_file_and_its_name_in_the_table(package_copy):
    """A relative scheme of a test's own, added as a contributor would: its file in
    positions/ and one line in SCHEMES (and the import that line needs). Nothing else
    changes, and GPTConfig, training, generation's rolling cache and the counts take it."""
    package_copy.write("attention/positions/decay.py", DECAY)
    package_copy.insert_after("attention/positions/__init__.py", "positions.base import",
                              "from gptmini.attention.positions.decay import DecayPositions")
    package_copy.insert_after("attention/positions/__init__.py", '"none": NoPositions,',
                              '    "decay": DecayPositions,')
    assert package_copy.changed() == ["attention/positions/__init__.py",
                                      "attention/positions/decay.py"]
    got = json.loads(package_copy.run(TRAIN_AND_GENERATE).splitlines()[-1])
    first, last = got["losses"]
    assert last < 0.8 * first  # it learns the batch
    assert got["applied"] > 1e-3  # its scores are not the plain ones
    assert got["rolled"] == got["window"]  # asked whether it is relative, and it is
    assert got["embedding_parameters"] == 64 * 16  # the tokens' only: none of positions
    assert "use one of learned, rope, alibi, none, decay" in got["named"]


@pytest.mark.parametrize(("name", "relative", "embedded"), [
    ("learned", False, True), ("rope", True, False), ("alibi", True, False),
    ("none", True, False)])
def test_each_scheme_says_whether_it_is_relative_and_embeds(tiny_config, name, relative,
                                                            embedded):
    model = GPTModel(replace(tiny_config, position=name))
    scheme = model.position_scheme
    assert isinstance(scheme, SCHEMES[name]) and scheme.relative is relative
    assert (scheme.embedding is not None) is embedded is hasattr(model, "pos_emb")
    # one object, shared by every layer and by the contexts the model builds
    assert all(block.att.settings.position_scheme is scheme for block in model.trf_blocks)
    assert model.new_context(1, 3).settings.position_scheme is scheme


def test_a_module_takes_a_scheme_or_its_short_form_not_both():
    x = torch.randn(2, 5, 8)
    torch.manual_seed(0)
    short = MultiHeadAttention(8, 8, 16, 0.0, 2, rope_theta=100.0)
    torch.manual_seed(0)
    scheme = MultiHeadAttention(8, 8, 16, 0.0, 2,
                                position_scheme=RotaryPositions(head_dim=4, theta=100.0))
    assert torch.equal(short(x), scheme(x))
    with pytest.raises(ValueError, match="rope_theta and alibi each choose how positions "
                                         "enter: pass one"):
        MultiHeadAttention(8, 8, 16, 0.0, 2, rope_theta=100.0, alibi=True)
    with pytest.raises(ValueError, match="head_dim=3 is invalid: rotary positions turn"):
        MultiHeadAttention(6, 6, 16, 0.0, 2, rope_theta=100.0)
    with pytest.raises(ValueError, match="rope_theta=0.0 is invalid: use a finite base above 1"):
        RotaryPositions(head_dim=4, theta=0.0)


@pytest.mark.parametrize("theta", [1.0, 0.5, 0.0, -3.0, float("nan")])
def test_the_rotary_base_has_one_rule_for_the_scheme_and_the_config(tiny_config, theta):
    """RotaryPositions and GPTConfig.rope_theta refuse the same bases with the same fix (the
    scheme's rule, which the config asks): a finite base above 1."""
    with pytest.raises(ValueError) as scheme:
        RotaryPositions(head_dim=4, theta=theta)
    with pytest.raises(ConfigError) as config:
        GPTConfig(**{**tiny_config.to_dict(), "position": "rope", "rope_theta": theta})
    assert config.value.field == "rope_theta" and config.value.fix == scheme.value.fix
    assert "use a finite base above 1" in config.value.fix
