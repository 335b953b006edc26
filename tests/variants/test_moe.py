"""The mixture of experts (gptmini.variants.moe, GPTConfig.mlp "moe"): the layer equals a
token-by-token oracle written here and transformers' Qwen3MoeSparseMoeBlock with the same
weights, its load-balancing loss equals transformers' load_balancing_loss_func over the
layers' router logits, its options are checked by name, its FLOPs count the active experts,
and a model of it generates with the cache equal to recompute and is served by the engine."""

import pytest
import torch
import torch.nn.functional as F

from gptmini.generate.engine import Engine
from gptmini.generate.loop import generate
from gptmini.model import MLPS, ConfigError, GPTConfig, GPTModel, lm_loss
from gptmini.model.flops import flops_per_token, num_parameters
from gptmini.variants.moe import BALANCE, MixtureOfExperts, MoE


def moe_config(**options) -> GPTConfig:
    fields = {"vocab_size": 97, "context_length": 48, "emb_dim": 16, "n_heads": 2,
              "n_layers": 2, "drop_rate": 0.0, "position": "rope", "norm": "rmsnorm",
              "bias": False, "mlp": "moe", "mlp_hidden_dim": 12}
    return GPTConfig(**fields, mlp_options={"experts": 5, "top_k": 2, **options})


def random_moe(seed=0, **kwargs) -> MixtureOfExperts:
    torch.manual_seed(seed)
    layer = MixtureOfExperts(**{"emb_dim": 16, "hidden_dim": 12, "experts": 5, "top_k": 2,
                                **kwargs}).double()
    with torch.no_grad():  # a router sharp enough that the top k are far apart
        layer.gate.weight.normal_(0, 1.0)
    return layer


def oracle(layer: MixtureOfExperts, x: torch.Tensor) -> torch.Tensor:
    """The mixture token by token: softmax over the router's scores, the k largest (their
    weights renormalized with norm_topk_prob), the weighted sum of those experts' SwiGLUs,
    plus the shared expert; every matmul written out."""
    out = torch.zeros_like(x)
    for i, token in enumerate(x):
        probs = torch.softmax(token @ layer.gate.weight.T, dim=-1)
        picked = sorted(range(len(probs)), key=lambda e: -probs[e])[:layer.top_k]
        total = sum(probs[e] for e in picked) if layer.norm_topk_prob else 1.0
        for e in picked:
            expert = layer.experts[e]
            hidden = F.silu(token @ expert.gate_proj.weight.T) * (token @ expert.up_proj.weight.T)
            out[i] += probs[e] / total * (hidden @ expert.down_proj.weight.T)
        if layer.shared_expert is not None:
            shared = layer.shared_expert
            hidden = F.silu(token @ shared.gate_proj.weight.T) * (token @ shared.up_proj.weight.T)
            out[i] += hidden @ shared.down_proj.weight.T
    return out


@pytest.mark.parametrize("kwargs", [{}, {"norm_topk_prob": False}, {"top_k": 1},
                                    {"top_k": 5}, {"shared_hidden_dim": 10}],
                         ids=["norm", "softmax-weights", "top-1", "every-expert", "shared"])
def test_the_layer_equals_the_token_by_token_oracle(kwargs):
    layer = random_moe(bias=False, **kwargs)
    x = torch.randn(3, 7, 16, dtype=torch.float64)
    with torch.no_grad():
        expected = oracle(layer, x.reshape(-1, 16)).view(3, 7, 16)
        torch.testing.assert_close(layer(x), expected, rtol=1e-12, atol=1e-12)


def test_the_layer_equals_transformers_qwen3_moe_block():
    modeling = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
    from transformers import Qwen3MoeConfig

    for norm in (True, False):
        config = Qwen3MoeConfig(hidden_size=16, moe_intermediate_size=12, num_experts=5,
                                num_experts_per_tok=2, norm_topk_prob=norm,
                                experts_implementation="eager")
        theirs = modeling.Qwen3MoeSparseMoeBlock(config).double()
        ours = random_moe(norm_topk_prob=norm)
        with torch.no_grad():  # their experts fused: (E, 2h, d) gate rows first, (E, d, h)
            theirs.gate.weight.copy_(ours.gate.weight)
            theirs.experts.gate_up_proj.copy_(torch.stack([
                torch.cat([e.gate_proj.weight, e.up_proj.weight]) for e in ours.experts]))
            theirs.experts.down_proj.copy_(torch.stack([e.down_proj.weight
                                                        for e in ours.experts]))
            x = torch.randn(2, 9, 16, dtype=torch.float64)
            # transformers routes in float32 even here: equal to about 1e-7
            torch.testing.assert_close(ours(x), theirs(x), rtol=1e-6, atol=1e-7)


def test_the_load_balancing_loss_is_transformers_over_every_layers_router_logits():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    cfg = moe_config(aux_loss_coef=0.25)
    model = GPTModel(cfg).double()
    logits = []  # each layer's router logits, as transformers' output_router_logits gives
    hooks = [block.ff.gate.register_forward_hook(lambda m, i, out: logits.append(out))
             for block in model.trf_blocks]
    idx = torch.randint(0, 97, (3, 11))
    targets = torch.randint(0, 97, (3, 11))
    parts = {}
    lm = lm_loss(model, idx, targets, aux_losses=parts)
    for hook in hooks:
        hook.remove()
    want = 0.25 * load_balancing_loss_func(tuple(logits), 5, 2)
    assert list(parts) == [BALANCE]
    torch.testing.assert_close(parts[BALANCE].float(), want.float(), rtol=1e-6, atol=0)
    # not the sum of a loss per layer: unbalanced layers do not cancel in that one
    per_layer = sum(0.25 * load_balancing_loss_func((g,), 5, 2) for g in logits) / 2
    assert abs((per_layer - want).item()) > 1e-4
    torch.testing.assert_close(lm, lm_loss(model, idx, targets))  # the LM's loss alone
    parts[BALANCE].backward()  # the balance trains the routers
    assert all(block.ff.gate.weight.grad.abs().sum() > 0 for block in model.trf_blocks)


def test_the_layer_adds_its_statistics_only_when_asked():
    layer = random_moe()
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    parts: dict = {}
    torch.testing.assert_close(layer(x, aux_losses=parts), layer(x))  # None: nothing asked
    share, prob = parts[BALANCE]  # (E,) each: the assignments' shares, mean probabilities
    assert share.sum().item() == pytest.approx(2.0) and prob.sum().item() == pytest.approx(1.0)


@pytest.mark.parametrize(("options", "message"), [
    ({"experts": 1}, "experts is 1: use a whole number >= 2"),
    ({"top_k": 6}, "top_k is 6: use a whole number from 1 to experts"),
    ({"top_k": 0}, "top_k is 0"),
    ({"norm_topk_prob": "yes"}, "norm_topk_prob is 'yes': use true or false"),
    ({"aux_loss_coef": -0.1}, "aux_loss_coef is -0.1: use a number >= 0"),
    ({"shared_hidden_dim": 0}, "shared_hidden_dim is 0: use a positive width, or null"),
    ({"expert": 4}, "the moe feed-forward has no option expert; it reads experts, top_k"),
])
def test_an_option_that_does_not_fit_is_named(options, message):
    with pytest.raises(ConfigError, match=r"GPTConfig.mlp_options=.* is invalid: .*"
                                          + message.replace("(", r"\(")):
        moe_config(**options)


def test_its_flops_count_the_active_experts_and_its_parameters_every_expert():
    assert "moe" in MLPS
    cfg = moe_config(shared_hidden_dim=8)
    dense = GPTConfig(**{**cfg.to_dict(), "mlp": "swiglu", "mlp_options": None})
    model = GPTModel(cfg)
    moe = model.feed_forward
    assert isinstance(moe, MoE) and (moe.experts, moe.top_k, moe.hidden_dim) == (5, 2, 12)
    # per layer: router d x E, 2 active experts of 3 * d * h, the shared one of 3 * d * 8
    active = 16 * 5 + 2 * 3 * 16 * 12 + 3 * 16 * 8
    swiglu = 3 * 16 * 12
    assert flops_per_token(cfg) - flops_per_token(dense) == 2 * 6 * (active - swiglu)
    held = 16 * 5 + 5 * 3 * 16 * 12 + 3 * 16 * 8
    assert num_parameters(model) - num_parameters(GPTModel(dense)) == 2 * (held - swiglu)


def test_the_default_expert_width_is_swiglus_split_over_the_active_experts():
    cfg = GPTConfig(**{**moe_config().to_dict(), "emb_dim": 96, "mlp_hidden_dim": None})
    swiglu = GPTConfig(**{**cfg.to_dict(), "mlp": "swiglu", "mlp_options": None}).hidden_dim
    assert (swiglu, cfg.hidden_dim) == (256, 128)


def test_the_cache_equals_recompute_and_the_engine_serves_it():
    torch.manual_seed(3)
    model = GPTModel(moe_config(shared_hidden_dim=8)).double().eval()
    with torch.no_grad():  # sharp routers, so that tokens really go different ways
        for block in model.trf_blocks:
            block.ff.gate.weight.normal_(0, 1.0)
    prompts = [[5, 17, 3], [44, 2, 90, 61, 7, 7, 12], [1]]
    plain = [generate(model, torch.tensor([p]), 12, use_cache=False)[0, len(p):].tolist()
             for p in prompts]
    cached = [generate(model, torch.tensor([p]), 12, use_cache=True)[0, len(p):].tolist()
              for p in prompts]
    assert cached == plain
    served = Engine(model, block_size=4, max_batch=3).generate(prompts, max_new_tokens=12)
    assert [r.tokens for r in served] == plain
    chosen = {int(c) for block in model.trf_blocks for c in block.ff.route(
        model.tok_emb.weight[:40])[1].flatten()}
    assert len(chosen) >= 4  # the test sees several experts, not one
