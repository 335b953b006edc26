"""The published models of the families gptmini names load (issue 45): for Llama 3.2 1B,
Llama 3.1 8B, Qwen3-0.6B, Qwen3-4B (and with its YaRN setting), Gemma 3 270M and 1B, a
config with the published head size, heads, key/value heads, rope type and settings, norms
and vocabulary handling (tests/convert/published.py says what is shrunk), random weights:

- loaded from transformers' own model and exported to it, logits within 1e-6 of
  transformers' (relative to the largest logit) in float64, both ways;
- the KV cache gives what recomputing gives, token by token;
- the engine serves it: every request gets what generate() gives it alone;
- its attention layer passes the conformance kit (padding, cache, relative positions, the
  window where it has one).
"""

import json
from dataclasses import replace

import pytest
import torch
from published import PUBLISHED, shrunk

from gptmini.attention import KVCache
from gptmini.convert import export_hf, load_hf
from gptmini.convert.hub import LAYOUTS, model_type
from gptmini.generate.engine import Engine
from gptmini.generate.loop import generate
from gptmini.model import GPTModel
from gptmini.testing import AttentionSpec, check_attention

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-6
"""Logits within this of transformers', relative to the largest: transformers computes the
rotary angles and Gemma's norms in float32 even in a float64 model, which leaves ~5e-7."""


def relative(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours - theirs).abs().max() / theirs.abs().max())


def transformers_model(hf_config: dict, seed: int):
    """transformers' own model of `hf_config`, random weights (norms too, so a norm swapped or
    left out cannot pass unseen), in float64 with weights drawn in float32 (what gptmini
    loads into its float32 parameters before .double())."""
    fields = {k: v for k, v in hf_config.items() if k not in ("model_type", "architectures")}
    config = transformers.CONFIG_MAPPING[hf_config["model_type"]](**fields)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.empty_like(p).uniform_(-0.5, 0.5))
    return model.double().eval()


@pytest.fixture(scope="module", params=list(PUBLISHED))
def published(request, tmp_path_factory):
    """(name, our model loaded from transformers' own, that model, the tokens compared)."""
    name = request.param
    hf = transformers_model(shrunk(name), seed=len(name))
    directory = tmp_path_factory.mktemp("hf")
    hf.save_pretrained(directory)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    return name, load_hf(directory).double(), hf, ids


def test_the_published_config_reads_as_its_shape(published):
    """The config as published (whole: every layer, the whole vocabulary) reads as the
    published head size, heads, key/value heads and rope settings."""
    name, _, _, _ = published
    config = PUBLISHED[name]
    cfg = LAYOUTS[model_type(config)].config_from(config)
    heads = config["num_attention_heads"]
    assert cfg.head_size == config.get("head_dim", config["hidden_size"] // heads)
    assert (cfg.n_heads, cfg.n_kv_heads or heads, cfg.n_layers, cfg.vocab_size) == (
        heads, config["num_key_value_heads"], config["num_hidden_layers"],
        config["vocab_size"])
    scaling = config.get("rope_scaling")
    assert cfg.rope_scaling == (None if scaling is None else {
        "rope_type": scaling["rope_type"], **{k: v for k, v in scaling.items()
                                              if k != "rope_type"}})
    assert cfg.tie_weights == config.get("tie_word_embeddings", True)


def test_loads_from_transformers_with_its_logits(published):
    name, ours, hf, ids = published
    with torch.no_grad():
        assert relative(ours(ids), hf(ids).logits) <= TOLERANCE, name


def test_exports_to_transformers_with_its_logits(published, tmp_path):
    name, loaded, _, ids = published
    torch.manual_seed(1)
    ours = GPTModel(loaded.cfg).double().eval()
    with torch.no_grad():  # random norms, as the other way
        for key, p in ours.named_parameters():
            if "norm" in key:
                p.add_(torch.empty_like(p).uniform_(-0.5, 0.5))
    export_hf(ours, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == PUBLISHED[name]["model_type"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float64, attn_implementation="eager").eval()
    with torch.no_grad():
        assert relative(ours(ids), hf(ids).logits) <= TOLERANCE, name


def test_the_kv_cache_gives_what_recomputing_gives(published):
    _, model, _, ids = published
    with torch.no_grad():
        full = model(ids)
        caches = model.new_kv_caches()
        steps = [model(ids[:, :9], kv_caches=caches)]
        steps += [model(ids[:, i:i + 1], kv_caches=caches) for i in range(9, ids.shape[1])]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0,
                               atol=1e-10 * float(full.abs().max()))


def test_the_engine_serves_it_as_generate_does(published):
    _, model, _, ids = published
    prompts = [ids[0, :5].tolist(), ids[1, :11].tolist(), ids[0, 3:17].tolist()]
    engine = Engine(model, block_size=4, num_blocks=48, max_batch=3)
    requests = [engine.add_request(p, max_new_tokens=6) for p in prompts]
    while engine.has_work:
        engine.step()
    for prompt, request in zip(prompts, requests, strict=True):
        alone = generate(model, torch.tensor([prompt]), 6, use_cache=True)
        assert request.tokens == alone[0, len(prompt):].tolist()


def kv_step(module, x_new, cache):
    cache = cache or KVCache()
    return module(x_new, kv_cache=cache), cache


def test_its_attention_layer_passes_the_conformance_kit(published):
    """The model's first layer's attention (a local one in Gemma, with its window and rope
    base) at the published heads and head size, fed a narrower input (64 wide)."""
    _, model, _, _ = published
    cfg, window = model.cfg, model.cfg.window_of(0)

    def layer(window_size=None):
        narrow = replace(cfg, emb_dim=64, head_dim=cfg.head_size, context_length=32,
                         layer_windows=None, window_size=window_size)
        return narrow.mixers()[0].make_module(0, narrow.position_scheme())

    spec = AttentionSpec(d_in=64, num_heads=cfg.n_heads, padding="attention_mask",
                         positions="positions", kv_step=kv_step,
                         window=None if window is None else 5)
    report = check_attention(layer, spec, time_budget=None)  # a loaded machine: no budget
    assert report.passed, str(report)
    ran = {r.name for r in report.results if r.status == "passed"}
    assert {"causality", "padding", "kv_cache", "relative_positions"} <= ran
