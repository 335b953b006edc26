"""Rotary frequency scaling (issue 45 item 2): each rope_type's frequencies and attention
factor are transformers' own (`ROPE_INIT_FUNCTIONS`), transformers changes none of them
while it generates (only its dynamic and longrope types do), and a model generates past the
original context the tokens transformers' generates; what is not a scaling is refused by
name."""

import pytest
import torch

from gptmini.attention.positions import rope_angles
from gptmini.attention.positions.scaling import ROPE_SCALINGS, rope_scaling
from gptmini.convert import load_hf
from gptmini.generate.loop import generate
from gptmini.model import ConfigError, GPTConfig

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

CASES = {  # name: (GPTConfig.rope_scaling, head size, rope_theta)
    "llama3, Llama 3.1 8B's": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192}, 128, 500000.0),
    "llama3, Llama 3.2 1B's": ({"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192}, 64, 500000.0),
    "linear, Gemma 3 4B's global layers'": ({"rope_type": "linear", "factor": 8.0}, 256, 1e6),
    "yarn, Qwen3's long context": ({"rope_type": "yarn", "factor": 4.0,
                                    "original_max_position_embeddings": 32768}, 128, 1e6),
    "yarn with DeepSeek's mscales": ({"rope_type": "yarn", "factor": 40.0, "mscale": 1.0,
                                      "mscale_all_dim": 0.5, "beta_fast": 32, "beta_slow": 1,
                                      "original_max_position_embeddings": 4096}, 64, 10000.0),
    "yarn, its own attention factor, not truncated": (
        {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64,
         "attention_factor": 0.9, "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False},
        32, 10000.0),
}


def hf_config(options: dict, head_dim: int, theta: float):
    return transformers.LlamaConfig(
        hidden_size=2 * head_dim, num_attention_heads=2, head_dim=head_dim,
        max_position_embeddings=1 << 20, rope_parameters={**options, "rope_theta": theta})


@pytest.mark.parametrize("case", CASES)
def test_frequencies_and_attention_factor_are_transformers_own(case):
    options, head_dim, theta = CASES[case]
    theirs, factor = ROPE_INIT_FUNCTIONS[options["rope_type"]](
        hf_config(options, head_dim, theta), "cpu")  # float32, as transformers computes them
    scaling = rope_scaling(options)
    ours = scaling.inv_freq(head_dim, theta, torch.float64)
    torch.testing.assert_close(ours.float(), theirs, rtol=1e-6, atol=0)
    assert scaling.magnitude == pytest.approx(factor, rel=1e-12)
    assert not torch.allclose(ours, scaling.inv_freq(head_dim, 2 * theta, torch.float64))


@pytest.mark.parametrize("kind", ROPE_SCALINGS)
def test_transformers_keeps_the_frequencies_past_the_original_context(kind):
    """transformers' rotary embedding after positions four times the original context: its
    frequencies unchanged (nothing dynamic for these types), its cos and sin ours."""
    options = next(o for o, _, _ in CASES.values() if o["rope_type"] == kind)
    options = {**options, "original_max_position_embeddings": 16} if kind != "linear" else options
    config = hf_config(options, 32, 10000.0)
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    before = rotary.inv_freq.clone()
    positions = torch.arange(64)[None]
    cos, sin = rotary(torch.zeros(1, 64, 32), positions)
    assert torch.equal(rotary.inv_freq, before)
    ours = rope_angles(positions, 32, 10000.0, torch.float64, scaling=rope_scaling(options))
    for mine, theirs in zip(ours, (cos, sin), strict=True):
        torch.testing.assert_close(mine[:, 0].float(), theirs, rtol=0, atol=2e-5)


@pytest.mark.parametrize(("kind", "settings"), [
    ("llama3", {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16}),
    ("yarn", {"factor": 4.0, "original_max_position_embeddings": 16}),
    ("linear", {"factor": 4.0}),
])
def test_generating_past_the_original_context_gives_transformers_tokens(tmp_path, kind,
                                                                         settings):
    """A Qwen3 (head size of its own) trained at 16 positions, scaled to 96: 60 greedy
    tokens after a 6-token prompt, with the KV cache, in float64."""
    torch.manual_seed(3)
    config = transformers.Qwen3Config(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=96, rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling={"rope_type": kind, **settings}, attn_implementation="eager")
    hf = transformers.Qwen3ForCausalLM(config).double().eval()
    hf.save_pretrained(tmp_path)
    ours = load_hf(tmp_path).double()
    assert ours.cfg.rope_scaling == {"rope_type": kind, **settings}
    prompt = torch.randint(0, 300, (1, 6))
    want = hf.generate(prompt, max_new_tokens=60, min_new_tokens=60, do_sample=False,
                       pad_token_id=0, attention_mask=torch.ones_like(prompt))
    assert torch.equal(generate(ours, prompt, 60, use_cache=True), want)


@pytest.mark.parametrize(("fields", "match"), [
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
     "rope_scaling=.* use a mapping with a rope_type of linear, llama3, yarn"),
    ({"rope_scaling": "linear"}, "rope_scaling='linear' is invalid"),
    ({"rope_scaling": {"rope_type": "linear"}}, "linear scaling reads factor; factor missing"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 0.5}}, "factor of 1 or more"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0,
                       "original_max_position_embeddings": 8, "truncate": 1}},
     "its truncate is 1: use true or false"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                       "high_freq_factor": 1.0, "original_max_position_embeddings": 8}},
     "high_freq_factor must be above its low_freq_factor"),
    ({"position": "learned", "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
     "rope_scaling=.* position 'learned' does not read it"),
    ({"position": "alibi", "rope_local_theta": 10000.0},
     "rope_local_theta=10000.0 is invalid: position 'alibi' does not read it"),
    ({"rope_scaling": {"rope_type": "default", "factor": 2.0}},
     "rope_type default scales nothing: leave out factor"),
    ({"rope_scaling": {"rope_type": "default", "partial_rotary_factor": 0.0}},
     "partial_rotary_factor is 0.0: use the share of each head that turns"),
    ({"rope_scaling": {"rope_type": "default", "partial_rotary_factor": float("nan")}},
     "partial_rotary_factor is nan"),
    ({"rope_scaling": {"rope_type": "default", "partial_rotary_factor": 0.05}},
     "it turns 3 of a head's 64 dimensions: .*even"),  # int(64 * 0.05), as transformers
])
def test_what_is_not_a_scaling_is_refused_by_name(fields, match):
    with pytest.raises(ConfigError, match=match):
        GPTConfig(**{"position": "rope", **fields})


def test_a_partial_share_turns_the_first_dimensions_as_rope_of_that_width():
    """Qwen3.5's 0.25 of a head of 16: the first 4 dimensions turn exactly as rotary
    positions of a 4-wide head (frequencies theta ** (-2i / 4)), the other 12 pass through,
    as transformers' Qwen3-Next and Qwen3.5 apply it."""
    cfg = GPTConfig(vocab_size=50, context_length=16, emb_dim=32, n_heads=2, n_layers=1,
                    position="rope", rope_theta=100.0,
                    rope_scaling={"rope_type": "default", "partial_rotary_factor": 0.25})
    scheme = cfg.position_scheme()
    assert scheme.rotary_dim == 4

    class Context:  # what rotate reads of a pass
        positions = torch.arange(7)[None]
        settings = type("Settings", (), {"window_size": None})()

        def once(self, key, make):
            return make()

    q, k = torch.randn(2, 1, 2, 7, 16, dtype=torch.float64)
    turned_q, turned_k = scheme.rotate(q, k, Context())
    for before, after in ((q, turned_q), (k, turned_k)):
        assert torch.equal(after[..., 4:], before[..., 4:])
        inv_freq = 100.0 ** (-torch.arange(0, 4, 2, dtype=torch.float64) / 4)  # (2,)
        angle = torch.arange(7, dtype=torch.float64)[:, None] * inv_freq  # (7, 2)
        x1, x2 = before[..., :2], before[..., 2:4]
        want = torch.cat([x1 * angle.cos() - x2 * angle.sin(),
                          x2 * angle.cos() + x1 * angle.sin()], dim=-1)
        torch.testing.assert_close(after[..., :4], want, rtol=0, atol=1e-12)
