"""The core (gptmini.core): what its import loads, the book's chapter 4 numbers, causality
that would catch the seed's masked_fill bug, and the core model equal to gptmini.model's
full one with the same weights (the default run's shape and the book's GPT-2)."""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import HANG_SECONDS

import gptmini.core as core
import gptmini.model as full
from gptmini.core.kernels import ExplicitKernel

REPO = Path(__file__).resolve().parents[2]
TINY = dict(vocab_size=64, context_length=32, emb_dim=16, n_heads=2, n_layers=2, drop_rate=0.0)


CORE_CEILING = 1_060
"""The most lines `import gptmini.core` may load. Issue 53's goal is 1,000; the core stands
59 above it with the hooks the layers around it subclass (AttentionContext.build's extra
arguments, GPTModel's make_blocks/embed/logits/residual_weights/new_context). Lower it as
it shrinks."""


def test_import_core_loads_at_most_8_modules_and_its_lines_and_nothing_but_torch():
    """Issue 53's goal, counted in a fresh interpreter: the gptmini modules `import
    gptmini.core` loads (at most 8), their lines (docstrings included), and every other
    module it loads beyond what torch had loaded (none but the standard library's)."""
    code = ("import json, sys, torch\nbefore = set(sys.modules)\nimport gptmini.core\n"
            "new = sorted(set(sys.modules) - before)\n"
            "print(json.dumps({n: getattr(sys.modules[n], '__file__', None) for n in new}))")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, text=True,
                          capture_output=True, timeout=HANG_SECONDS, check=True)
    new = json.loads(done.stdout.splitlines()[-1])
    ours = {name: file for name, file in new.items() if name.split(".")[0] == "gptmini"}
    others = [name for name in new if name.split(".")[0] not in ("gptmini", "torch")
              and name.split(".")[0] not in sys.stdlib_module_names]
    assert others == [], f"import gptmini.core loaded {others}"
    lines = {name: len(Path(file).read_text().splitlines()) for name, file in ours.items()}
    assert len(lines) <= 8 and sum(lines.values()) <= CORE_CEILING, lines


def greedy(model, idx: torch.Tensor, steps: int) -> list[int]:
    with torch.no_grad():
        for _ in range(steps):
            idx = torch.cat([idx, model(idx)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return idx[0].tolist()


@pytest.mark.parametrize("model_class", [core.GPTModel, full.GPTModel], ids=["core", "model"])
def test_the_books_seeded_gpt_prints_the_books_numbers(model_class):
    """Chapter 4: `torch.manual_seed(123); GPTModel(GPT_CONFIG_124M)` (the book passes its
    dict), 163,009,536 parameters, and "Hello, I am" continued greedily by the untrained
    model with the token ids the book prints (listing 4.8's output)."""
    torch.manual_seed(123)
    model = model_class(core.GPT_CONFIG_124M).eval()
    assert sum(p.numel() for p in model.parameters()) == 163_009_536
    got = greedy(model, torch.tensor([[15496, 11, 314, 716]]), 6)
    assert got == [15496, 11, 314, 716, 27018, 24086, 47843, 30961, 42348, 7267]


class UnderscorelessKernel:
    """The seed's exercise solution: `masked_fill` without the underscore masks nothing."""

    has_dropout = True

    def __call__(self, queries, keys, values, context, dropout_p=0.0):
        scores = queries @ keys.transpose(2, 3)
        allowed = context.dense()
        if allowed is not None:
            scores.masked_fill(~allowed, -torch.inf)  # returns a new tensor: the bug
        return torch.softmax(scores / keys.shape[-1] ** 0.5, dim=-1) @ values


def later_tokens_move_earlier_outputs(model, i: int = 5) -> bool:
    """Change the tokens after position i: do the outputs up to i move?"""
    idx = torch.randint(0, 64, (2, 12))
    changed = idx.clone()
    changed[:, i + 1:] = torch.randint(0, 64, (2, 12 - i - 1))
    with torch.no_grad():
        return not torch.equal(model(idx)[:, : i + 1], model(changed)[:, : i + 1])


@pytest.mark.parametrize("backend", ["sdpa", "explicit"])
def test_no_output_sees_a_later_token_and_the_check_catches_the_seeds_bug(backend):
    cfg = core.GPTConfig(**TINY, attention_backend=backend)
    model = core.GPTModel(cfg).eval()
    assert not later_tokens_move_earlier_outputs(model)
    for block in model.trf_blocks:
        block.att.backend = UnderscorelessKernel
    assert later_tokens_move_earlier_outputs(model)


BOOK_GPT2 = dict(vocab_size=64, context_length=32, emb_dim=32, n_heads=4, n_layers=2,
                 drop_rate=0.0, qkv_bias=True, tie_weights=True)
DEFAULT_RUN = dict(vocab_size=64, context_length=32, emb_dim=32, n_heads=4, n_layers=2,
                   drop_rate=0.0, n_kv_heads=1, attention_backend="explicit", tie_weights=True,
                   position="rope", norm="rmsnorm", norm_eps=1e-6, mlp="swiglu",
                   qk_norm=True, bias=False)


@pytest.mark.parametrize("fields", [BOOK_GPT2, DEFAULT_RUN], ids=["gpt2", "default-run"])
def test_the_core_model_equals_the_full_one_with_its_weights(fields):
    """The default run's blocks and the book's GPT-2 built from the core alone load the
    full model's state dict as it is, and give its logits (float64): alone, left-padded,
    and token by token through a KV cache."""
    torch.manual_seed(0)
    theirs = full.init_gpt2_weights(full.GPTModel(full.GPTConfig(**fields))).double().eval()
    ours = core.GPTModel(core.GPTConfig(**fields)).double().eval()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    idx = torch.randint(0, 64, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), theirs(idx), rtol=1e-12, atol=1e-12)
        padded = torch.cat([torch.zeros(2, 3, dtype=torch.long), idx], dim=1)
        mask = torch.cat([torch.zeros(2, 3), torch.ones(2, 10)], dim=1)
        torch.testing.assert_close(ours(padded, mask)[:, 3:], ours(idx), rtol=1e-10, atol=1e-12)
        caches = ours.new_kv_caches()
        stepped = torch.cat([ours(idx[:, :4], kv_caches=caches)] + [
            ours(idx[:, t: t + 1], kv_caches=caches) for t in range(4, 10)], dim=1)
        torch.testing.assert_close(stepped, ours(idx), rtol=1e-10, atol=1e-12)


def test_the_explicit_path_equals_sdpa_in_the_core():
    cfg = core.GPTConfig(**TINY, position="rope", n_kv_heads=1)
    model = core.GPTModel(cfg).double().eval()
    idx = torch.randint(0, 64, (3, 9))
    with torch.no_grad():
        fast = model(idx)
        for block in model.trf_blocks:
            block.att.backend = ExplicitKernel
        torch.testing.assert_close(model(idx), fast, rtol=1e-10, atol=1e-12)


def test_gpt2_initialisation_is_chosen_where_a_run_is_set_up():
    """The core's constructor keeps PyTorch's defaults (the book's); gptmini.model's
    init_gpt2_weights draws GPT-2's on it from outside: N(0, 0.02), the residual
    projections (the core's residual_weights) 0.02 / sqrt(2 * n_layers), biases zero."""
    cfg = core.GPTConfig(**{**TINY, "emb_dim": 256, "n_layers": 8, "n_heads": 4})
    model = core.GPTModel(cfg)
    assert model.tok_emb.weight.std() > 0.5  # nn.Embedding's N(0, 1)
    full.init_gpt2_weights(model)
    assert abs(model.tok_emb.weight.std() - 0.02) < 0.002
    assert abs(model.trf_blocks[0].att.out_proj.weight.std() - 0.02 / 4) < 0.0005
    assert abs(model.trf_blocks[0].att.W_query.weight.std() - 0.02) < 0.002
    assert model.trf_blocks[0].ff.layers[0].bias.abs().max() == 0


def test_a_bad_field_is_named_with_its_fix():
    with pytest.raises(core.ConfigError, match=r"GPTConfig.n_kv_heads=5 is invalid: use a "
                                               "divisor of the 12 query heads"):
        core.GPTConfig(n_kv_heads=5)
    with pytest.raises(core.ConfigError, match="GPTConfig.mlp='moe' is invalid: use one of "
                                               "gelu, swiglu"):
        core.GPTConfig(mlp="moe")
    with pytest.raises(core.ConfigError, match="GPTConfig.n_heads=5"):
        replace(core.GPTConfig(), n_heads=5)
