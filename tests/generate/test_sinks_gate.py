"""Attention sinks and gated attention through generation, the engine and the page: the
engine's tokens equal generate()'s alone (float64, as tests/generate/test_engine.py), the
KV cache equals recompute, and the page's weights are the sink's (rows summing below 1)."""

import random

import torch

from gptmini.analysis.inspection import inspect_text
from gptmini.generate.engine import Engine, SamplingParams
from gptmini.generate.loop import generate
from gptmini.model import GPTConfig, GPTModel


def _model(**options) -> GPTModel:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=257, context_length=48, emb_dim=32, n_heads=4, n_layers=2,
                    drop_rate=0.0, attn_sinks=True, attn_gate="headwise", **options)
    model = GPTModel(cfg).double().eval()
    with torch.no_grad():
        for block in model.trf_blocks:
            block.att.sinks.normal_(0.0, 2.0)
    return model


def test_the_engine_serves_sinks_and_gates_as_generate_does_alone():
    model = _model(window_size=8, n_kv_heads=2)
    rng = random.Random(3)
    requests = [([rng.randrange(256) for _ in range(rng.randint(1, 30))], rng.randint(1, 20))
                for _ in range(8)]
    engine = Engine(model, block_size=4, max_batch=4)
    added = [engine.add_request(prompt, max_new_tokens=n) for prompt, n in requests]
    while engine.has_work:
        engine.step()
    for (prompt, n), request in zip(requests, added, strict=True):
        alone = generate(model, torch.tensor([prompt]), n, use_cache=True,
                         sampling=SamplingParams())
        assert request.tokens == alone[0, len(prompt):].tolist()


def test_generation_with_the_cache_equals_recompute():
    model = _model()
    prompt = torch.randint(0, 257, (2, 5))
    cached = generate(model, prompt, 30, use_cache=True)  # slides past the context
    recomputed = generate(model, prompt, 30, use_cache=False)
    assert torch.equal(cached, recomputed)


def test_the_page_shows_weights_that_leave_the_sinks_share():
    model = _model()
    seen = inspect_text(model, list(range(1, 12)))
    sums = seen.weights.sum(-1)  # (n_layers, n_heads, num_tokens)
    assert (sums < 1).all() and (sums > 0).all()
    assert (seen.weights.triu(diagonal=1) == 0).all()  # a sink changes no causality
