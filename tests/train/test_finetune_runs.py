"""Fine-tuning runs end to end through train.py: LoRA (adapters alone in the checkpoint,
loaded onto their base and merged, a wrong base refused, exported) and classification
(labels from CSV records, scored by evaluate.py)."""

import csv

import pytest
import torch
from helpers import REPO, save_checkpoint, tiny_args

from gptmini.analysis.evaluate import evaluate_main
from gptmini.checkpoint import load_checkpoint
from gptmini.convert import export_hf, load_hf
from gptmini.finetune import add_class_head, add_lora
from gptmini.model import GPTConfig, GPTModel
from gptmini.train.command import main

SOURCE = dict(vocab_size=50257, context_length=16, emb_dim=32, n_heads=2, n_layers=2,
              drop_rate=0.0, qkv_bias=True, position="learned", norm="layernorm", mlp="gelu",
              tie_weights=True)
SHAPE_FLAGS = ("--model.context_length", "--model.emb_dim", "--model.n_heads",
               "--model.n_layers", "--model.tokenizer")


def run_args(tmp_path, corpus, config: str, source, *extra: str) -> list[str]:
    """A shipped config on the tests' tiny run, from `source`, without architecture flags."""
    args = tiny_args(tmp_path, corpus)
    args = [a for i, a in enumerate(args)
            if a not in SHAPE_FLAGS and not (i and args[i - 1] in SHAPE_FLAGS)]
    return ["--config", str(REPO / "configs" / config), *args, "--model.init_from",
            str(source), *extra]


def source_checkpoint(path, seed: int):
    torch.manual_seed(seed)
    return save_checkpoint(GPTModel(GPTConfig(**SOURCE)), path)


@pytest.mark.slow
def test_a_lora_run_saves_adapters_that_load_onto_their_base_and_nowhere_else(
        tmp_path, corpus, capsys):
    source = source_checkpoint(tmp_path / "base.ckpt", 0)
    args = run_args(tmp_path, corpus, "lora-shakespeare.yaml", source, "--model.lora_rank", "4",
                    "--trainer.max_steps", "4", "--checkpoint_every", "2")
    assert main(args) == 0
    assert "LoRA rank 4 on W_query, W_key, W_value, out_proj: 2,048 of" in capsys.readouterr().out
    last = tmp_path / "runs" / "tiny" / "checkpoints" / "last.ckpt"
    saved = torch.load(last, weights_only=True)
    assert saved["state_dict"] and all(k.endswith(("lora_A", "lora_B"))
                                       for k in saved["state_dict"])
    assert last.stat().st_size <= 0.05 * source.stat().st_size

    # The oracle: the base with the adapters beside it, unmerged, against the loaded merge.
    model, tokenizer, _ = load_checkpoint(last)
    unmerged = GPTModel(GPTConfig(**SOURCE))
    unmerged.load_state_dict(load_checkpoint(source).model.state_dict())
    add_lora(unmerged, rank=4, alpha=16.0)
    unmerged.load_state_dict({k[len("model."):]: v for k, v in saved["state_dict"].items()},
                             strict=False)
    idx = torch.randint(0, 50257, (2, 16))
    with torch.no_grad():
        assert any(bool(v.abs().sum()) for k, v in saved["state_dict"].items()
                   if k.endswith("lora_B"))  # trained: B left zero
        torch.testing.assert_close(model(idx), unmerged.eval()(idx), atol=1e-5, rtol=0)
        exported = load_hf(export_hf(model, tmp_path / "merged", tokenizer))
        torch.testing.assert_close(exported(idx), model(idx), atol=1e-5, rtol=0)

    other = source_checkpoint(tmp_path / "other.ckpt", 1)
    with pytest.raises(ValueError, match=f"trained on the base {source} .*not on {other}"):
        load_checkpoint(last, base=other)
    # A resume reloads the base and restores the adapters and their optimizer.
    assert main([*args, "--trainer.max_steps", "6", "--ckpt_path", "last"]) == 0
    assert torch.load(last, weights_only=True)["global_step"] == 6
    source.rename(tmp_path / "moved.ckpt")
    with pytest.raises(FileNotFoundError, match=f"trained on the base {source}, which is not"):
        load_checkpoint(last)


def write_records(path, n: int, seed: int):
    """A separable task: a class's texts share its words."""
    rng = torch.Generator().manual_seed(seed)
    words = {"spam": "win money prize now free".split(), "ham": "see you at lunch soon".split()}
    with open(path, "w", newline="") as file:
        writer = csv.DictWriter(file, ["Text", "Label"])
        writer.writeheader()
        for i in range(n):
            label = ("spam", "ham")[i % 2]
            picks = torch.randint(0, 5, (6,), generator=rng).tolist()
            writer.writerow({"Text": " ".join(words[label][j] for j in picks), "Label": label})
    return path


@pytest.mark.slow
def test_a_classifier_trains_on_csv_records_and_evaluate_reports_its_accuracy(
        tmp_path, corpus, capsys):
    source = source_checkpoint(tmp_path / "base.ckpt", 0)
    train, val = write_records(tmp_path / "train.csv", 64, 0), write_records(
        tmp_path / "val.csv", 12, 1)
    args = run_args(tmp_path, corpus, "classify-genres.yaml", source,
                    "--data.labels.task", "null", "--data.labels.label_field", "Label",
                    "--data.corpus.text_field", "Text", "--data.corpus.source", str(train),
                    "--data.corpus.val_source", str(val), "--trainer.max_steps", "20",
                    "--model.learning_rate", "3e-3", "--trainer.limit_val_batches", "1.0")
    assert main(args) == 0
    best = tmp_path / "runs" / "tiny" / "checkpoints" / "best.ckpt"
    report = capsys.readouterr().out
    following = report[report.rindex("\nnext\n"):]  # before: generate.py and serve.py
    assert "evaluate.py --checkpoint" in following and "acc " in report
    assert "generate.py" not in following and "serve.py" not in following
    assert evaluate_main(["--checkpoint", str(best)]) == 0
    out = capsys.readouterr().out
    model, tokenizer, hparams = load_checkpoint(best)
    assert hparams["classes"] == ["ham", "spam"]
    # The oracle: each record alone, unpadded, its last token through the head.
    with open(val) as file:
        rows = list(csv.DictReader(file))
    with torch.no_grad():
        right = sum(int(model(torch.tensor([tokenizer.encode(r["Text"])]))[0, -1].argmax())
                    == ["ham", "spam"].index(r["Label"]) for r in rows)
    assert f"12 examples\naccuracy {right / 12:.4f}" in out
    assert "true \\ predicted" in out and "spam" in out.splitlines()[-1]


def test_classification_records_missing_their_label_are_named(tmp_path, corpus, capsys):
    source = source_checkpoint(tmp_path / "base.ckpt", 0)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a", "label": "x"}\n{"text": "b"}\n')
    args = run_args(tmp_path, corpus, "classify-genres.yaml", source, "--data.labels.task",
                    "null", "--data.labels.label_field", "label", "--data.corpus.source",
                    str(bad))
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "bad.jsonl, record 2: no 'label'" in err and "Traceback" not in err


def test_the_class_head_of_a_checkpoint_comes_back(tmp_path):
    torch.manual_seed(0)
    model = add_class_head(GPTModel(GPTConfig(**SOURCE)), 3)
    path = save_checkpoint(model, tmp_path / "c.ckpt")
    ckpt = torch.load(path, weights_only=True)
    ckpt["hyper_parameters"]["classes"] = ["a", "b", "c"]
    torch.save(ckpt, path)
    loaded = load_checkpoint(path).model
    idx = torch.randint(0, 50257, (1, 8))
    torch.testing.assert_close(loaded(idx), model.eval()(idx))
