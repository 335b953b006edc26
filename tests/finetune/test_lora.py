"""LoRA: merged equals unmerged, only adapters get gradients, the default targets' share,
and an adapter checkpoint that loads onto its base and refuses another."""

import math

import pytest
import torch
from torch import nn

from gptmini.finetune import (
    LORA_TARGETS,
    LoRALinear,
    add_class_head,
    add_lora,
    count_parameters,
    lora_layers,
    merge_lora,
)
from gptmini.model import GPT_CONFIG_124M, GPTConfig, GPTModel, lm_loss

QWEN3_BLOCKS = dict(vocab_size=97, context_length=16, emb_dim=32, n_heads=4, n_layers=2,
                    drop_rate=0.0, position="rope", norm="rmsnorm", mlp="swiglu", bias=False,
                    qk_norm=True, tie_weights=True)


def adapted(targets=("W_query", "W_key", "W_value", "out_proj", "mlp"), **overrides) -> GPTModel:
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(**{**QWEN3_BLOCKS, **overrides}))
    add_lora(model, rank=4, alpha=8.0, targets=targets)
    with torch.no_grad():  # B starts at zero: give it values, or merging proves nothing
        for layer in lora_layers(model).values():
            layer.lora_B.normal_(0, 0.2)
    return model.eval()


@pytest.mark.parametrize("blocks", [{}, dict(position="learned", norm="layernorm", mlp="gelu",
                                             bias=True, qk_norm=False, qkv_bias=True)],
                         ids=["qwen3", "gpt2"])
def test_the_merged_model_computes_the_unmerged_logits(blocks):
    model = adapted(**blocks)
    idx = torch.randint(0, 97, (3, 16))
    with torch.no_grad():
        unmerged = model(idx)
        plain = GPTModel(model.cfg)  # the base alone computes something else
        plain.load_state_dict(model.state_dict(), strict=False)
        assert (plain.eval()(idx) - unmerged).abs().max() > 1e-3
        merged = merge_lora(model)(idx)
    assert not lora_layers(model) and not any("lora" in k for k in model.state_dict())
    torch.testing.assert_close(merged, unmerged, atol=1e-5, rtol=0)


def test_only_the_adapters_get_gradients_and_fresh_adapters_change_nothing():
    torch.manual_seed(1)
    base = GPTModel(GPTConfig(**QWEN3_BLOCKS)).eval()
    idx = torch.randint(0, 97, (2, 16))
    before = base(idx).detach()
    add_lora(base, rank=2, alpha=4.0, targets=["W_query", "mlp"])
    torch.testing.assert_close(base(idx), before, atol=0, rtol=0)  # B = 0: the base's output
    lm_loss(base, idx, idx).backward()
    with_grad = {n for n, p in base.named_parameters() if p.grad is not None}
    adapters = {n for n, p in base.named_parameters() if n.endswith(("lora_A", "lora_B"))}
    assert with_grad == adapters and len(adapters) == 2 * 2 * (1 + 3)  # layers x (q + mlp)


def test_rank_8_on_the_default_model_trains_under_2_percent():
    default = GPTConfig(vocab_size=4096, context_length=128, emb_dim=256, n_heads=4,
                        n_layers=4, tie_weights=True, position="rope", norm="rmsnorm",
                        mlp="swiglu", qk_norm=True, bias=False)
    model = add_lora(GPTModel(default), rank=8, alpha=16.0)
    trainable, total = count_parameters(model)
    assert trainable == 4 * 4 * 8 * (256 + 256)  # layers x projections x rank x (in + out)
    assert trainable / total <= 0.02


def test_a_layer_keeps_the_bases_names_and_bad_settings_are_named():
    model = adapted()
    layer = model.trf_blocks[0].att.W_query
    assert isinstance(layer, LoRALinear) and isinstance(layer, torch.nn.Linear)
    assert {"trf_blocks.0.att.W_query.weight", "trf_blocks.0.att.W_query.lora_A"} <= set(
        model.state_dict())
    with pytest.raises(ValueError, match="lora_targets=.*'W_q'.*use some of W_query"):
        add_lora(GPTModel(GPTConfig(**QWEN3_BLOCKS)), rank=2, alpha=1.0, targets=["W_q"])
    with pytest.raises(ValueError, match="lora_rank=0"):
        add_lora(GPTModel(GPTConfig(**QWEN3_BLOCKS)), rank=0, alpha=1.0)
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        add_lora(model, rank=2, alpha=1.0)


def test_the_books_count_and_draw_beside_ours():
    """The book's appendix E adapts every nn.Linear of its chapter 6 classifier, the class
    head included: its printed 2,666,528 trainable at rank 16. Ours adapts the blocks'
    layers and trains the 2-class head whole (its 1,538 weights; the book's adapters on it
    would be 12,320). Its A is kaiming_uniform_(a=sqrt(5)) on an (in, rank) tensor, whose
    fan-in is the rank: bound 1/sqrt(16) = 0.25; ours draws as nn.Linear(in, rank) does,
    as PEFT's: 1/sqrt(768) = 0.036. docs/finetuning.md says why."""
    with torch.device("meta"):
        model = add_class_head(GPTModel(GPTConfig(**GPT_CONFIG_124M)), 2)
    book = sum(16 * (m.in_features + m.out_features) for m in model.modules()
               if isinstance(m, nn.Linear))
    assert book == 2_666_528
    add_lora(model, rank=16, alpha=16.0, targets=LORA_TARGETS)
    model.out_head.requires_grad_(True)  # what the classification task does
    assert count_parameters(model)[0] == 2_654_208 + 1_538

    torch.manual_seed(0)
    book_a = torch.empty(768, 16)  # the book's LoRALayer: self.A = torch.empty(in_dim, rank)
    nn.init.kaiming_uniform_(book_a, a=math.sqrt(5))
    ours = LoRALinear(nn.Linear(768, 768), rank=16, alpha=16.0).lora_A
    assert 0.24 < book_a.abs().max() <= 0.25
    assert 0.035 < ours.abs().max() <= 1 / math.sqrt(768)
