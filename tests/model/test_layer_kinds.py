"""GPTConfig.layer_kinds: Gated DeltaNet layers mixed with attention (Qwen3-Next's 3:1),
through the model, its caches and generate()."""

import pytest
import torch

from gptmini.attention import KVCache
from gptmini.generate.loop import generate, left_pad
from gptmini.model import ConfigError, GPTConfig, GPTModel, lm_loss
from gptmini.variants import GatedDeltaNet
from gptmini.variants.deltanet import DeltaNetState

QWEN3_NEXT = ["deltanet", "deltanet", "deltanet", "attention"]


def hybrid(seed: int = 0, **overrides) -> GPTModel:
    fields = dict(vocab_size=97, context_length=24, emb_dim=16, n_heads=2, n_layers=4,
                  drop_rate=0.0, position="rope", norm="rmsnorm", mlp="swiglu",
                  layer_kinds=QWEN3_NEXT)
    torch.manual_seed(seed)
    return GPTModel(GPTConfig(**{**fields, **overrides})).double().eval()


@pytest.mark.parametrize("kinds", [["deltanet"] * 3, ["attention", "mamba", "deltanet", "x"],
                                   "deltanet"])
def test_a_bad_pattern_is_refused_naming_the_field(kinds):
    with pytest.raises(ConfigError, match="layer_kinds") as err:
        GPTConfig(n_layers=4, emb_dim=16, n_heads=2, layer_kinds=kinds)
    assert "deltanet, attention" in str(err.value)


def test_the_pattern_builds_its_blocks_and_caches():
    model = hybrid()
    assert [isinstance(b.att, GatedDeltaNet) for b in model.trf_blocks] == [True] * 3 + [False]
    assert [mixer.title for mixer in model.mixers] == ["Gated DeltaNet"] * 3 + ["attention"]
    assert [type(c) for c in model.new_kv_caches()] == [DeltaNetState] * 3 + [KVCache]
    assert GPTModel(GPTConfig(n_layers=2, emb_dim=16, n_heads=2)).new_kv_caches()[0].__class__ \
        is KVCache  # no pattern: attention everywhere, as before


@pytest.mark.parametrize("kinds", [QWEN3_NEXT, ["deltanet"] * 4])
def test_cached_decoding_equals_recompute(kinds):
    model = hybrid(layer_kinds=kinds)
    idx = torch.randint(0, 97, (2, 14))
    full = model(idx)
    caches = model.new_kv_caches()
    steps = [model(idx[:, :9], kv_caches=caches)]
    steps += [model(idx[:, t : t + 1], kv_caches=caches) for t in range(9, 14)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-10, atol=1e-10)
    # and generate()'s cache gives recompute's tokens, also past the context (recomputed)
    prompt = idx[:, :5]
    cached = generate(model, prompt, 30, use_cache=True)
    assert torch.equal(cached, generate(model, prompt, 30, use_cache=False))


def test_left_padded_batch_generates_each_prompt_as_alone():
    model = hybrid()
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    idx, mask = left_pad(prompts, pad_id=0)
    logits = model(idx, mask)
    together = generate(model, idx, 6, attention_mask=mask)
    for row, prompt in enumerate(prompts):
        alone_logits = model(torch.tensor([prompt]))[0]
        torch.testing.assert_close(logits[row, -len(prompt):], alone_logits,
                                   rtol=1e-10, atol=1e-10)
        alone = generate(model, torch.tensor([prompt]), 6)
        assert together[row, -6:].tolist() == alone[0, -6:].tolist()


def test_a_deltanet_layer_is_causal():
    model = hybrid()
    idx = torch.randint(0, 97, (1, 12))
    changed = idx.clone()
    changed[0, 7:] = (changed[0, 7:] + 1) % 97
    torch.testing.assert_close(model(changed)[:, :7], model(idx)[:, :7], rtol=0, atol=0)


def test_attention_weights_are_refused_naming_the_deltanet_layers():
    with pytest.raises(ValueError, match=r"layers \[0, 1, 2\] are Gated DeltaNet"):
        hybrid().attention_weights(torch.randint(0, 97, (1, 5)))


def test_packed_documents_and_rolling_are_refused_by_name():
    model = hybrid()
    idx = torch.randint(0, 97, (1, 6))
    with pytest.raises(ValueError, match="document_ids"):
        model(idx, document_ids=torch.tensor([[0, 0, 0, 1, 1, 1]]))
    with pytest.raises(ValueError, match="slide='recompute'"):
        generate(model, idx, 30, slide="roll")


def test_trains_one_step_and_keeps_old_checkpoints_loading():
    model = hybrid().float().train()
    idx = torch.randint(0, 97, (2, 12))
    loss = lm_loss(model, idx[:, :-1], idx[:, 1:])
    loss.backward()
    mixer = model.trf_blocks[0].att
    for name in ("W_query", "W_beta", "W_decay", "W_gate", "conv1d", "out_proj"):
        assert getattr(mixer, name).weight.grad.abs().sum() > 0, name
    assert mixer.A_log.grad.abs().sum() > 0 and mixer.dt_bias.grad.abs().sum() > 0
    # a config written before layer_kinds existed loads as attention everywhere
    old = {k: v for k, v in GPTConfig(n_layers=2, emb_dim=16, n_heads=2).to_dict().items()
           if k != "layer_kinds"}
    assert GPTConfig(**old).layer_kinds is None


def test_export_to_hugging_face_layouts_is_refused_naming_layer_kinds():
    from gptmini.convert.gpt2 import config_to_hf as config_to_gpt2
    from gptmini.convert.llama import config_to_llama

    with pytest.raises(ValueError, match="layer_kinds"):
        config_to_llama(hybrid().cfg)
    with pytest.raises(ValueError, match="layer_kinds"):
        config_to_gpt2(hybrid(position="learned", norm="layernorm", mlp="gelu").cfg)
