import dataclasses
import inspect
import math
import re

import pytest
import torch
import torch.nn.functional as F

from gptmini.attention import MultiHeadAttention
from gptmini.model import (
    GPT_CONFIG_124M,
    PRESETS,
    ConfigError,
    GPTConfig,
    GPTModel,
    init_gpt2_weights,
    lm_loss,
)
from gptmini.model.flops import num_parameters


def test_book_config_dict_builds_a_config():
    cfg = GPTConfig(**GPT_CONFIG_124M)
    assert (cfg.emb_dim, cfg.n_layers, cfg.n_heads, cfg.context_length) == (768, 12, 12, 1024)


def test_124m_parameter_count_matches_the_book():
    """Book section 4.6: 163,009,536 with a separate output head, 124,412,160 tied."""
    with torch.device("meta"):
        untied = GPTModel(GPTConfig(**GPT_CONFIG_124M))
        tied = GPTModel(GPTConfig(**GPT_CONFIG_124M, tie_weights=True))
    assert num_parameters(untied) == 163_009_536
    assert num_parameters(tied) == 124_412_160
    assert tied.out_head.weight is tied.tok_emb.weight


@pytest.mark.parametrize(
    ("preset", "count"),
    [  # Hugging Face's GPT-2 checkpoints have exactly these many parameters
        ("gpt2-124m", 124_439_808),
        ("gpt2-355m", 354_823_168),
        ("gpt2-774m", 774_030_080),
        ("gpt2-1558m", 1_557_611_200),
    ],
)


def test_gpt2_presets_have_gpt2_sizes(preset, count):
    with torch.device("meta"):
        model = GPTModel(GPTConfig.from_preset(preset))
    assert num_parameters(model) == count


def test_every_preset_is_a_valid_config():
    for name in PRESETS:
        GPTConfig.from_preset(name)
    with pytest.raises(ValueError, match="unknown preset 'gpt5'"):
        GPTConfig.from_preset("gpt5")


def test_forward_shapes(tiny_config):
    model = GPTModel(tiny_config)
    logits = model(torch.randint(0, 64, (3, 11)))
    assert logits.shape == (3, 11, 64)


def test_untrained_loss_is_near_log_vocab():
    cfg = GPTConfig.from_preset("cpu-tiny")
    model = init_gpt2_weights(GPTModel(cfg)).eval()  # where a training run starts
    idx = torch.randint(0, cfg.vocab_size, (4, 33))
    logits = model(idx[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.1


@pytest.mark.parametrize("extra", [{}, {"n_kv_heads": 1}, {"window_size": 4}])
@pytest.mark.parametrize("i", [0, 5, 10])
def test_model_logits_never_depend_on_future_tokens(tiny_config, extra, i):
    cfg = GPTConfig(**{**tiny_config.to_dict(), **extra})
    model = GPTModel(cfg).eval()
    idx = torch.randint(0, 64, (2, 16))
    changed = idx.clone()
    changed[:, i + 1 :] = torch.randint(0, 64, changed[:, i + 1 :].shape)
    torch.testing.assert_close(model(idx)[:, : i + 1], model(changed)[:, : i + 1])


def test_left_padded_batch_gives_each_prompt_its_own_logits(tiny_config):
    model = GPTModel(tiny_config).eval()
    prompts = [torch.randint(0, 64, (n,)) for n in (9, 4, 6)]
    width = 9
    idx = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.long)
    for row, p in enumerate(prompts):
        idx[row, width - len(p) :], mask[row, width - len(p) :] = p, 1
    logits = model(idx, mask)
    assert not logits.isnan().any()
    for row, p in enumerate(prompts):
        alone = model(p[None])[0]
        torch.testing.assert_close(logits[row, width - len(p) :], alone, atol=1e-5, rtol=1e-5)


def test_kv_cache_prefill_and_decode_equal_full_forward(tiny_config):
    model = GPTModel(tiny_config).eval()
    idx = torch.randint(0, 64, (2, 12))
    caches = model.new_kv_caches()
    pieces = [model(idx[:, :5], kv_caches=caches)]
    pieces += [model(idx[:, t : t + 1], kv_caches=caches) for t in range(5, 12)]
    torch.testing.assert_close(torch.cat(pieces, 1), model(idx), atol=1e-5, rtol=1e-5)


def test_attention_weights_gives_each_layers_causal_weights(tiny_config):
    model = GPTModel(tiny_config).eval()
    idx = torch.randint(0, 64, (1, 7))
    weights = model.attention_weights(idx)
    assert len(weights) == tiny_config.n_layers
    for w in weights:
        assert w.shape == (1, tiny_config.n_heads, 7, 7)
        assert (w.triu(diagonal=1) == 0).all()


def test_forward_returns_the_logits_alone():
    """Issue 53: one return shape; the loss is lm_loss's, the weights attention_weights'."""
    signature = inspect.signature(GPTModel.forward)
    assert signature.return_annotation in (torch.Tensor, "Tensor")
    assert not {"targets", "reduction", "return_weights", "return_parts"} & set(
        signature.parameters)


def test_too_long_input_says_how_to_crop(tiny_config):
    model = GPTModel(tiny_config)
    with pytest.raises(ValueError, match="context_length is 32; crop to the last 32"):
        model(torch.zeros(1, 33, dtype=torch.long))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("n_heads", 5, "GPTConfig.n_heads=5 is invalid: it must divide the width (16)"),
        ("emb_dim", 0, "GPTConfig.emb_dim=0 is invalid: use a positive integer"),
        ("drop_rate", 1.5, "GPTConfig.drop_rate=1.5 is invalid"),
        ("n_kv_heads", 3, "GPTConfig.n_kv_heads=3 is invalid: use a divisor of the 2 query heads"),
        ("window_size", 0, "GPTConfig.window_size=0 is invalid"),
    ],
)


def test_invalid_config_names_the_field_and_fix(tiny_config, field, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        GPTConfig(**{**tiny_config.to_dict(), field: value})


def test_gpt2_initialization_scales_residual_projections(tiny_config):
    model = GPTModel(GPTConfig(**{**tiny_config.to_dict(), "emb_dim": 256, "n_heads": 4}))
    assert model.tok_emb.weight.std() > 0.5  # the constructor keeps PyTorch's (the book's)
    init_gpt2_weights(model)
    proj_std = model.trf_blocks[0].att.out_proj.weight.std().item()
    q_std = model.trf_blocks[0].att.W_query.weight.std().item()
    assert abs(q_std - 0.02) < 0.002
    assert abs(proj_std - 0.02 / math.sqrt(2 * 2)) < 0.002


def _in_the_books_layout(model: GPTModel) -> dict:
    """`model`'s state dict as the book's chapter 4 GPTModel names it: LayerNorm parameters
    `scale`/`shift`, and every attention module's registered causal `mask` buffer."""
    book = {}
    for key, value in model.state_dict().items():
        if "norm" in key:
            key = key.replace(".weight", ".scale").replace(".bias", ".shift")
        book[key] = value.clone()
    n = model.cfg.context_length
    for i in range(model.cfg.n_layers):
        book[f"trf_blocks.{i}.att.mask"] = torch.triu(torch.ones(n, n), diagonal=1)
    return book


def test_a_state_dict_saved_by_the_books_gptmodel_loads_strictly():
    cfg = GPTConfig(vocab_size=97, context_length=12, emb_dim=16, n_heads=2, n_layers=2,
                    drop_rate=0.0, qkv_bias=True)
    torch.manual_seed(0)
    trained = GPTModel(cfg).eval()
    with torch.no_grad():  # LayerNorm gains and biases away from their 1/0 defaults
        for name, p in trained.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p))
    fresh = GPTModel(cfg).eval()
    fresh.load_state_dict(_in_the_books_layout(trained), strict=True)
    idx = torch.randint(0, 97, (2, 12))
    assert torch.equal(fresh(idx), trained(idx))


def test_multihead_attention_loads_a_state_dict_with_the_books_mask_buffer():
    torch.manual_seed(0)
    ours = MultiHeadAttention(4, 4, 6, 0.0, num_heads=2)
    book_state = {**ours.state_dict(), "mask": torch.triu(torch.ones(6, 6), diagonal=1)}
    other = MultiHeadAttention(4, 4, 6, 0.0, num_heads=2)
    other.load_state_dict(book_state, strict=True)
    x = torch.randn(1, 6, 4)
    assert torch.equal(other(x), ours(x))


def test_padded_vocabulary_widens_the_weights_but_logits_cover_only_real_ids(tiny_config):
    cfg = GPTConfig(**{**tiny_config.to_dict(), "padded_vocab_size": 128, "tie_weights": True})
    model = GPTModel(cfg).eval()
    assert model.tok_emb.weight.shape == model.out_head.weight.shape == (128, 16)
    logits = model(torch.randint(0, 64, (2, 5)))
    assert logits.shape == (2, 5, 64)
    full = model.out_head(model.final_norm(model.trf_blocks[-1](
        model.trf_blocks[0](model.tok_emb(torch.zeros(1, 1, dtype=torch.long))
                            + model.pos_emb(torch.zeros(1, dtype=torch.long))))))
    assert full.shape[-1] == 128  # the head computes the padded width; forward drops it
    with pytest.raises(ValueError, match="padded_vocab_size=32 is invalid: use at least"):
        GPTConfig(**{**tiny_config.to_dict(), "padded_vocab_size": 32})


def test_fit_vocab_names_a_wide_vocabulary_as_padding(tiny_config):
    wide = GPTConfig(**{**tiny_config.to_dict(), "vocab_size": 128})
    fitted = wide.fit_vocab(64)
    assert (fitted.vocab_size, fitted.padded_vocab_size, fitted.vocab_width) == (64, 128, 128)
    assert wide.fit_vocab(128) is wide
    with pytest.raises(ValueError, match="its tokenizer has 200 ids"):
        wide.fit_vocab(200)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_lm_loss_is_the_cross_entropy_of_the_logits(tiny_config, reduction):
    model = GPTModel(tiny_config).eval()
    idx, targets = torch.randint(0, 64, (3, 9)), torch.randint(0, 64, (3, 9))
    targets[1, 4:] = -100  # positions that count for nothing
    loss = lm_loss(model, idx, targets, reduction=reduction)
    per_token = F.cross_entropy(model(idx).flatten(0, 1).double(), targets.flatten(),
                                ignore_index=-100, reduction="none").view(3, 9)
    expected = {"mean": per_token.sum() / (targets != -100).sum(), "sum": per_token.sum(),
                "none": per_token}[reduction]
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="reduction must be"):
        lm_loss(model, idx, targets, reduction="average")


def test_a_bf16_model_returns_its_loss_in_float32(tiny_config):
    model = GPTModel(tiny_config).to(torch.bfloat16)
    loss = lm_loss(model, torch.randint(0, 64, (2, 5)), torch.randint(0, 64, (2, 5)))
    assert loss.dtype == torch.float32 and abs(loss.item() - math.log(64)) < 0.3


@pytest.mark.parametrize("keep", [1, 3])
def test_logits_to_keep_computes_only_the_last_positions(tiny_config, keep):
    model = GPTModel(tiny_config).eval()
    idx = torch.randint(0, 64, (2, 7))
    head_rows = []
    model.out_head.register_forward_hook(lambda m, args, out: head_rows.append(args[0].shape[1]))
    last = model(idx, logits_to_keep=keep)
    assert head_rows == [keep] and last.shape == (2, keep, 64)
    torch.testing.assert_close(last, model(idx)[:, -keep:], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_a_chunked_loss_equals_the_whole_one_with_its_gradients(tiny_config, reduction):
    model = GPTModel(tiny_config).double()
    idx, targets = torch.randint(0, 64, (3, 10)), torch.randint(0, 64, (3, 10))
    targets[2, :3] = -100
    whole = lm_loss(model, idx, targets, reduction=reduction)
    grads = torch.autograd.grad(whole.sum(), list(model.parameters()))
    chunked = lm_loss(model, idx, targets, reduction=reduction, chunk_size=7)
    assert whole.dtype == chunked.dtype == torch.float64
    torch.testing.assert_close(chunked, whole)
    for a, b in zip(torch.autograd.grad(chunked.sum(), list(model.parameters())), grads,
                    strict=True):
        torch.testing.assert_close(a, b)


FLOAT_FIELDS = {  # every float setting of GPTConfig: a value in range, and where it ends
    "drop_rate": (0.0, [1.0, -0.1]),
    "attn_drop_rate": (0.5, [1.0, -0.1]),
    "norm_eps": (1e-6, [0.0, -1e-5, 1.0, 1e300]),
    "rope_theta": (500000.0, [1.0, 0.5, -10000.0]),
    "attn_softcap": (30.0, [0.0, -5.0]),
    "rope_local_theta": (10000.0, [1.0, 0.5, -5.0]),
    "attn_scale_dim": (168.0, [0.0, -1.0]),
    "logit_softcap": (30.0, [0.0, -5.0]),
}
NOT_FINITE = [float("nan"), float("inf"), float("-inf"), "0.1", True, [0.1]]


def test_every_float_field_is_checked():
    floats = {f.name for f in dataclasses.fields(GPTConfig)
              if "float" in str(f.type) and f.name != "padded_vocab_size"}
    assert floats == set(FLOAT_FIELDS)  # a new float field gets its rows here


@pytest.mark.parametrize("field", FLOAT_FIELDS)
def test_a_float_field_must_be_finite_and_in_range(tiny_config, field):
    good, out_of_range = FLOAT_FIELDS[field]
    base = {**tiny_config.to_dict(), "position": "rope"}
    assert getattr(GPTConfig(**{**base, field: good}), field) == good
    for value in [*out_of_range, *NOT_FINITE]:
        with pytest.raises(ConfigError) as caught:
            GPTConfig(**{**base, field: value})
        assert caught.value.field == field and f"GPTConfig.{field}={value!r}" in str(caught.value)
        assert caught.value.for_flag().startswith(f"--model.{field} {value!r} is invalid: use")
