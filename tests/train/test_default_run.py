"""The default run's recipe end to end, on a tiny shape: it trains (with its optimizer), and
its checkpoint alone generates, serves, draws attention and exports."""

import json
from pathlib import Path

import pytest
import torch
import yaml
from helpers import REPO, tiny_args

from gptmini.analysis.visualize import visualize_main
from gptmini.checkpoint import load_checkpoint
from gptmini.convert import export_hf
from gptmini.generate.command import generate_main
from gptmini.generate.engine import Engine
from gptmini.generate.loop import generate
from gptmini.train.command import DEFAULT_CONFIG, main

RECIPE = ("position", "norm", "mlp", "qk_norm", "bias", "tie_weights", "n_kv_heads",
          "attention_backend")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("default")
    corpus = tmp / "corpus.txt"
    corpus.write_text("ROMEO: But soft, what light through yonder window breaks?\n" * 60)
    assert main(tiny_args(tmp, corpus, "--trainer.max_steps", "8")) == 0
    return tmp / "runs" / "tiny" / "checkpoints" / "last.ckpt"


@pytest.mark.slow
def test_the_checkpoint_holds_the_default_runs_recipe(checkpoint):
    default = yaml.safe_load(DEFAULT_CONFIG.read_text())["model"]
    ckpt = torch.load(checkpoint, weights_only=True)
    assert ckpt["hyper_parameters"]["optimizer"] == default.get("optimizer", "adamw")
    cfg = load_checkpoint(checkpoint).model.cfg
    for field in RECIPE:
        if field in default:
            assert getattr(cfg, field) == default[field], field


@pytest.mark.slow
def test_generate_py_and_the_engine_continue_a_prompt_alike(checkpoint, capsys):
    assert generate_main(["--checkpoint", str(checkpoint), "--prompt", "ROMEO:",
                          "--max_new_tokens", "6", "--temperature", "0"]) == 0
    printed = capsys.readouterr().out
    model, tokenizer, _ = load_checkpoint(checkpoint)
    prompt = tokenizer.encode("ROMEO:")
    greedy = generate(model, torch.tensor([prompt]), 6, use_cache=True)[0, len(prompt):]
    assert tokenizer.decode(greedy.tolist()) in printed
    engine = Engine(model, tokenizer, block_size=4)
    request = engine.add_request(prompt, max_new_tokens=6)
    while engine.has_work:
        engine.step()
    assert request.tokens == greedy.tolist()


@pytest.mark.slow
def test_the_server_answers_from_the_checkpoint(checkpoint):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from gptmini.serve.app import create_app

    model, tokenizer, _ = load_checkpoint(checkpoint)
    app = create_app(Engine(model, tokenizer, block_size=4), "tiny")
    with TestClient(app) as client:
        answer = client.post("/v1/completions", json={"model": "tiny", "prompt": "ROMEO:",
                                                      "max_tokens": 4, "temperature": 0})
    assert answer.status_code == httpx.codes.OK, answer.text
    assert answer.json()["usage"]["completion_tokens"] > 0


@pytest.mark.slow
def test_visualize_draws_the_attention_of_the_checkpoint(checkpoint, tmp_path):
    png = tmp_path / "attention.png"
    assert visualize_main(["attention", "--checkpoint", str(checkpoint), "--prompt", "ROMEO:",
                           "--out", str(png)]) == 0
    assert png.stat().st_size > 0


@pytest.mark.slow
def test_the_checkpoint_exports_and_transformers_computes_the_same_logits(checkpoint, tmp_path):
    transformers = pytest.importorskip("transformers")
    model, tokenizer, _ = load_checkpoint(checkpoint)
    directory = export_hf(model, tmp_path / "hf", tokenizer)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    ids = torch.tensor([tokenizer.encode("ROMEO: But soft")])
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, model(ids), rtol=1e-4, atol=1e-4)
    cfg = model.cfg
    layout = ("gpt2" if (cfg.position, cfg.mlp) != ("rope", "swiglu")
              else "qwen3" if cfg.qk_norm else "llama")
    assert json.loads((directory / "config.json").read_text())["model_type"] == layout


BOOK_DEFAULT = {  # the default run before the speedrun (gptmini/configs/shakespeare-cpu.yaml
    # at 1845543), with GPTConfig's defaults of then for what it left unset
    "model": {"tokenizer": "bpe:4096", "context_length": 128, "emb_dim": 256, "n_heads": 4,
              "n_layers": 4, "drop_rate": 0.0, "tie_weights": True, "learning_rate": 0.002,
              "warmup_steps": 100, "min_lr_ratio": 0.1, "weight_decay": 0.1,
              "position": "learned", "norm": "layernorm", "norm_eps": 1e-5, "mlp": "gelu",
              "qk_norm": False, "bias": True, "optimizer": "adamw", "n_kv_heads": None,
              "attention_backend": "sdpa", "compile": False},
    "trainer": {"max_steps": 2400, "val_check_interval": 200, "limit_val_batches": 20,
                "gradient_clip_val": 1.0},
    "data": {"loader.batch_size": 8, "corpus.val_fraction": 0.05, "corpus.source": None},
}


def test_book_gpt2_yaml_is_the_default_run_of_before(capsys):
    from gptmini.train.command import build_cli

    with pytest.raises(SystemExit):
        build_cli(["--config", str(REPO / "configs" / "book-gpt2.yaml"), "--print_config"])
    printed = yaml.safe_load(capsys.readouterr().out)
    for section, fields in BOOK_DEFAULT.items():
        for field, value in fields.items():
            found = printed[section]
            for key in field.split("."):  # data's settings are grouped: data.loader.batch_size
                found = found[key]
            assert found == value, f"{section}.{field}"
