"""Multi-head latent attention (gptmini.attention.latent) against transformers' DeepseekV3,
its cache against recompute, and its absorbed decoding against the plain path."""

import pytest
import torch

from gptmini.attention import AttentionContext, AttentionSettings, KVCache
from gptmini.attention.positions import RotaryPositions
from gptmini.model import GPTConfig, GPTModel
from gptmini.variants import MultiHeadLatentAttention

transformers = pytest.importorskip("transformers")

SIZES = {"kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6}


def tiny_config(**overrides) -> GPTConfig:
    fields = {"vocab_size": 97, "context_length": 32, "emb_dim": 32, "n_heads": 4,
              "n_layers": 2, "drop_rate": 0.0, "position": "rope", "norm": "rmsnorm",
              "norm_eps": 1e-6, "mlp": "swiglu", "mlp_hidden_dim": 48, "bias": False,
              "layer_kinds": ["mla"] * 2}
    mla = {**SIZES, **overrides.pop("mla", {})}
    return GPTConfig(**{**fields, "mixer_options": {"mla": mla}, **overrides})


def mla(cfg: GPTConfig) -> dict:
    """The MLA sizes `cfg` was given (the tests give every one but q_lora_rank)."""
    return {"q_lora_rank": None, **cfg.mixer_options["mla"]}


def deepseek(cfg: GPTConfig, rope_interleave: bool):
    """transformers' DeepseekV3 of cfg's shape, every layer dense (no MoE)."""
    hf_cfg = transformers.DeepseekV3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.emb_dim, intermediate_size=cfg.hidden_dim,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_heads, kv_lora_rank=mla(cfg)["kv_lora_rank"],
        q_lora_rank=mla(cfg)["q_lora_rank"], qk_rope_head_dim=mla(cfg)["qk_rope_head_dim"],
        qk_nope_head_dim=mla(cfg)["qk_nope_head_dim"], v_head_dim=mla(cfg)["v_head_dim"],
        first_k_dense_replace=cfg.n_layers, max_position_embeddings=cfg.context_length,
        rms_norm_eps=cfg.norm_eps, rope_interleave=rope_interleave, attention_bias=False,
        tie_word_embeddings=False, rope_parameters={"rope_type": "default",
                                                    "rope_theta": cfg.rope_theta})
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(1)
    return transformers.DeepseekV3ForCausalLM(hf_cfg).double().eval()


def rope_rows(cfg: GPTConfig, interleave: bool) -> torch.Tensor:
    """DeepSeek's interleaved rotary pairs (2i, 2i + 1) in gptmini's halves (i, i + r/2):
    the order of the rotary rows to take from a Hugging Face weight."""
    rope = mla(cfg)["qk_rope_head_dim"]
    return torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)]) if interleave \
        else torch.arange(rope)


def our_name(hf_name: str) -> str | None:
    """gptmini's name of a DeepseekV3ForCausalLM parameter, written by hand (None: a buffer)."""
    fixed = {"model.embed_tokens.weight": "tok_emb.weight", "model.norm.weight":
             "final_norm.weight", "lm_head.weight": "out_head.weight"}
    if hf_name in fixed:
        return fixed[hf_name]
    if "rotary_emb" in hf_name:
        return None
    _, _, layer, rest = hf_name.split(".", 3)
    rest = (rest.replace("input_layernorm", "norm1").replace("post_attention_layernorm", "norm2")
            .replace("self_attn.o_proj", "att.out_proj").replace("self_attn.", "att.")
            .replace("mlp.", "ff."))
    return f"trf_blocks.{layer}.{rest}"


def hf_to_gptmini(hf_state: dict, cfg: GPTConfig, interleave: bool) -> dict:
    """A state dict of GPTModel from DeepseekV3ForCausalLM's, written here independently of
    the model code: names by hand, and DeepSeek's interleaved rotary pairs (2i, 2i + 1)
    reordered into gptmini's halves (i, i + r/2), in the query's and the rotary key's rows."""
    rope, nope = mla(cfg)["qk_rope_head_dim"], mla(cfg)["qk_nope_head_dim"]
    perm = (torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)]) if interleave
            else torch.arange(rope))
    q_rows = torch.cat([torch.cat([torch.arange(nope), nope + perm]) + h * (nope + rope)
                        for h in range(cfg.n_heads)])
    kv_rows = torch.cat([torch.arange(mla(cfg)["kv_lora_rank"]), mla(cfg)["kv_lora_rank"] + perm])
    ours = {}
    for key, value in hf_state.items():
        name = our_name(key)
        if name is None:
            continue
        if name.endswith(("att.q_proj.weight", "att.q_b_proj.weight")):
            value = value[q_rows]
        elif name.endswith("att.kv_a_proj_with_mqa.weight"):
            value = value[kv_rows]
        ours[name] = value
    return ours


# transformers' DeepseekV3 runs its RMSNorms and rotary angles in float32 even in a float64
# model, so its logits (|logit| < 1 here) are good to ~1e-7; a wrong weight or rotary layout
# moves them by ~1e-2.
HF_ATOL = 2e-6


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("q_lora_rank", [None, 12])
def test_whole_model_logits_equal_transformers_deepseek_v3(interleave, q_lora_rank):
    cfg = tiny_config(mla={"q_lora_rank": q_lora_rank})
    hf = deepseek(cfg, interleave)
    model = GPTModel(cfg).double().eval()
    model.load_state_dict(hf_to_gptmini(hf.state_dict(), cfg, interleave), strict=True)
    idx = torch.randint(0, cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(idx).logits
        got = model(idx)
    torch.testing.assert_close(got, expected, rtol=0, atol=HF_ATOL)


def test_weights_load_the_other_way_too():
    """gptmini's random weights, loaded into DeepseekV3 (the inverse mapping), give its logits."""
    cfg = tiny_config(mla={"q_lora_rank": 12})
    hf = deepseek(cfg, rope_interleave=False)
    torch.manual_seed(3)
    model = GPTModel(cfg).double().eval()
    inverse = {our_name(k): k for k in hf.state_dict() if our_name(k) is not None}
    missing, _ = hf.load_state_dict({inverse[k]: v for k, v in model.state_dict().items()},
                                    strict=False)
    assert all("rotary_emb" in k for k in missing)
    idx = torch.randint(0, cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(idx), hf(idx).logits, rtol=0, atol=HF_ATOL)


def test_cache_holds_the_latent_and_rotary_key_and_equals_recompute():
    cfg = tiny_config(mla={"q_lora_rank": 12})
    torch.manual_seed(0)
    model = GPTModel(cfg).double().eval()
    idx = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(idx)
        for absorb in (None, True, False):
            for block in model.trf_blocks:
                block.att.absorb = absorb
            caches = model.new_kv_caches()
            steps = [model(idx[:, :5], kv_caches=caches)]
            steps += [model(idx[:, i : i + 1], kv_caches=caches) for i in range(5, 12)]
            torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-12)
            # (b, 1, num_tokens, kv_lora_rank) latents and (b, 1, num_tokens, rope) keys only
            assert caches[0].keys.shape == (2, 1, 12, mla(cfg)["kv_lora_rank"])
            assert caches[0].values.shape == (2, 1, 12, mla(cfg)["qk_rope_head_dim"])


def test_latent_cache_reproduces_the_full_keys():
    """The keys expanded from the cached latent and rotary key are the keys a plain
    projection of the same tokens gives (what MHA's cache would have held)."""
    torch.manual_seed(0)
    att = MultiHeadLatentAttention(32, 16, 0.0, 4, **SIZES,
                                   position_scheme=RotaryPositions(head_dim=4)).double()
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    cache = KVCache()
    with torch.no_grad():
        att(x, kv_cache=cache)
        latent = att.kv_a_layernorm(att.kv_a_proj_with_mqa(x)[..., :16])
    k_nope = att.kv_b_proj(latent).view(2, 7, 4, 14)[..., :8]  # (b, n, heads, nope)
    expanded = att.kv_b_proj(cache.keys[:, 0]).view(2, 7, 4, 14)[..., :8]
    torch.testing.assert_close(expanded, k_nope, rtol=0, atol=1e-12)


@pytest.mark.parametrize("backend", ["sdpa", "explicit", "flex", "tiled"])
@pytest.mark.parametrize("absorb", [False, True])
def test_absorbed_equals_plain_on_every_kernel_with_padding_and_window(backend, absorb):
    torch.manual_seed(0)
    att = MultiHeadLatentAttention(32, 16, 0.0, 4, **SIZES, q_lora_rank=8, window_size=4,
                                   softcap=5.0, position_scheme=RotaryPositions(head_dim=4),
                                   backend="explicit", absorb=False).double()
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0  # left padding: those queries get zeros
    with torch.no_grad():
        expected = att(x, mask)
        att.backend, att.absorb = backend, absorb
        got = att(x, mask)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    assert got[1, :3].abs().max() == 0


def test_absorbed_weights_are_the_plain_weights():
    torch.manual_seed(0)
    att = MultiHeadLatentAttention(32, 16, 0.0, 4, **SIZES,
                                   position_scheme=RotaryPositions(head_dim=4)).double()
    x = torch.randn(1, 6, 32, dtype=torch.float64)
    with torch.no_grad():
        _, plain = att(x, return_weights=True)
        att.absorb = True
        _, absorbed = att(x, return_weights=True)
    torch.testing.assert_close(absorbed, plain, rtol=0, atol=1e-12)


def test_a_context_is_checked_and_seen_with_the_layers_window_as_multihead_attention_does():
    """MLA begins as MultiHeadAttention does (gptmini.attention.context.layer_context): a
    context of another window is seen through the layer's own, one of another shape or
    position scheme is refused by name."""
    torch.manual_seed(0)
    rope = RotaryPositions(head_dim=4)
    att = MultiHeadLatentAttention(32, 16, 0.0, 4, **SIZES, window_size=3,
                                   position_scheme=rope).double()
    x = torch.randn(1, 7, 32, dtype=torch.float64)
    with torch.no_grad():
        own = att(x)
        seen = att(x, context=AttentionContext.build(1, 7, settings=AttentionSettings(
            position_scheme=rope)))
    torch.testing.assert_close(seen, own, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"built for \(batch, num_tokens, num_keys\)"):
        att(x, context=AttentionContext.build(1, 6, settings=att.settings))
    with pytest.raises(ValueError, match="position_scheme=NoPositions"):
        att(x, context=AttentionContext.build(1, 7))
    with pytest.raises(ValueError, match="context_length is 16; crop"):
        att(torch.randn(1, 17, 32, dtype=torch.float64))


def test_no_future_token_moves_an_earlier_output():
    torch.manual_seed(0)
    att = MultiHeadLatentAttention(32, 16, 0.0, 4, **SIZES,
                                   position_scheme=RotaryPositions(head_dim=4)).double()
    x = torch.randn(1, 8, 32, dtype=torch.float64)
    changed = x.clone()
    changed[:, 5:] = torch.randn(1, 3, 32, dtype=torch.float64)
    for absorb in (False, True):
        att.absorb = absorb
        with torch.no_grad():
            torch.testing.assert_close(att(changed)[:, :5], att(x)[:, :5], rtol=0, atol=0)


def test_config_refuses_mla_options_without_mla_layers_and_gqa_with_them():
    with pytest.raises(ValueError, match="mixer_options=.*use a mapping from a mixer some "
                                         "layer has .*attention"):
        GPTConfig(mixer_options={"mla": {"v_head_dim": 8}})
    with pytest.raises(ValueError, match="the mla mixer has no option rank; it reads "
                                         "kv_lora_rank, q_lora_rank"):
        tiny_config(mla={"rank": 8})
    with pytest.raises(ValueError, match="n_kv_heads"):
        tiny_config(n_kv_heads=2)
    with pytest.raises(ValueError, match="mla's qk_rope_head_dim is 3: .* even"):
        tiny_config(mla={"qk_rope_head_dim": 3})


def test_a_checkpoint_with_the_mla_fields_of_before_mixer_options_loads_the_same(tmp_path):
    """A checkpoint train.py wrote before mixer_options held MLA's sizes (GPTConfig fields
    mla_kv_lora_rank, ...) loads as the same model and gives the same logits."""
    from gptmini.checkpoint import load_checkpoint, write_model_entries
    from gptmini.checkpoint.format import upgrade_fields
    from gptmini.tokenizer import get_tokenizer

    cfg = tiny_config(vocab_size=257, mla={"q_lora_rank": 12})
    torch.manual_seed(0)
    model = GPTModel(cfg).eval()
    fields = {k: v for k, v in cfg.to_dict().items() if k not in ("layer_kinds",
                                                                  "mixer_options")}
    old = {**fields, **{f"mla_{k}": v for k, v in mla(cfg).items()}}
    ckpt = {"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
            "hyper_parameters": {**old, "tokenizer": "byte"}}
    write_model_entries(ckpt, cfg, get_tokenizer("byte"), "32-true")
    ckpt["model_config"] = old  # as the older gptmini wrote it
    torch.save(ckpt, tmp_path / "old.ckpt")
    loaded = load_checkpoint(tmp_path / "old.ckpt").model
    assert loaded.cfg == cfg
    idx = torch.randint(0, 257, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(idx), model(idx))
    assert upgrade_fields({"n_layers": 2, "mla_kv_lora_rank": None}) == {"n_layers": 2}
    assert upgrade_fields({"n_layers": 2, "layer_kinds": ["attention", "deltanet"],
                           "mla_kv_lora_rank": 8})["layer_kinds"] == ["mla", "deltanet"]


def test_config_refuses_sinks_and_gate_that_mla_would_drop():
    """MultiHeadLatentAttention builds neither: the model would train without them."""
    with pytest.raises(ValueError, match="attn_sinks.*no sinks"):
        tiny_config(attn_sinks=True)
    with pytest.raises(ValueError, match="attn_gate.*no output gate"):
        tiny_config(attn_gate="elementwise")


def test_config_refuses_a_latent_wider_than_what_it_compresses():
    """4 heads x (8 + 6) = 56 dimensions of keys and values per token: a latent of 1000
    would cache more than attention's own keys and values (issue 48)."""
    with pytest.raises(ValueError, match="mla's kv_lora_rank of 1000 is a latent wider "
                                         r"than the 4 heads x 14 dimensions .*at most 56"):
        tiny_config(mla={"kv_lora_rank": 1000})
    with pytest.raises(ValueError, match="mla's q_lora_rank of 49 .* at most 48"):
        tiny_config(mla={"q_lora_rank": 49})
    tiny_config(mla={"kv_lora_rank": 56, "q_lora_rank": 48})


def latent_cache_step(module, x_new, cache):
    """The kit's kv_step: MLA's own cache (latents and rotary keys) across calls."""
    cache = KVCache() if cache is None else cache
    return module(x_new, kv_cache=cache), cache


@pytest.mark.parametrize("absorb", [None, True, False])
def test_conformance_kit_passes_with_padding_window_cache_and_positions(absorb):
    """The kit's properties, MLA's cache among them: stepping through the latent cache (plain
    or absorbed) equals attending over the whole input; rotary scores are relative."""
    from gptmini.testing import AttentionSpec, check_attention

    def mla(d_in, d_out, context_length, dropout, num_heads, qkv_bias=False, window_size=None):
        head_dim = d_out // num_heads
        return MultiHeadLatentAttention(
            d_in, context_length, dropout, num_heads, kv_lora_rank=2 * head_dim + 2,
            qk_nope_head_dim=head_dim, qk_rope_head_dim=2, v_head_dim=head_dim,
            qkv_bias=qkv_bias, window_size=window_size, absorb=absorb,
            position_scheme=RotaryPositions(head_dim=2))

    spec = AttentionSpec(padding="attention_mask", window=3, positions="positions",
                         kv_step=latent_cache_step)
    report = check_attention(mla, spec, time_budget=None)
    assert report.passed, str(report)
    ran = {r.name for r in report.results if r.status == "passed"}
    assert {"causality", "padding", "window", "kv_cache", "relative_positions"} <= ran


def test_page_inspection_shows_its_weights_and_the_engine_refuses_it_by_name():
    from gptmini.analysis.inspection import inspect_text
    from gptmini.generate.engine import Engine

    torch.manual_seed(0)
    model = GPTModel(tiny_config())
    seen = inspect_text(model, [1, 5, 9, 2])
    assert seen.weights.shape == (2, 4, 4, 4)  # (n_layers, n_heads, num_tokens, num_keys)
    torch.testing.assert_close(seen.weights.sum(-1), torch.ones(2, 4, 4))
    with pytest.raises(ValueError, match="multi-head latent attention"):
        Engine(model)
