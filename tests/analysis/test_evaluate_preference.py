"""evaluate.py --preference: held-out pairs scored for any checkpoint, the margins against a
reference (a preference run's starting weights by default) or, without one, the model's own
log-probability margins, checked against log_softmax by hand."""

import json

import pytest
import torch
from helpers import make_model, save_checkpoint

from gptmini.analysis.evaluate import evaluate_main
from gptmini.chat import BOOK_PREAMBLE
from gptmini.tokenizer import get_tokenizer

BYTES = get_tokenizer("byte")
PAIRS = [{"instruction": "Fix it.", "input": "He go.", "chosen": "He goes.",
          "rejected": "He goes, obviously."},
         {"instruction": "Greet.", "input": "", "chosen": "Hello there!", "rejected": "What?"},
         {"instruction": "Count.", "input": "", "chosen": "One, two.", "rejected": "One, two."}]


def log_prob(model, record: dict, response: str) -> float:
    """The book's prompt built by hand, the response's log-probability from the logits."""
    user = record["instruction"] + (f"\n\n### Input:\n{record['input']}" if record["input"]
                                    else "")
    prompt = BYTES.encode(f"{BOOK_PREAMBLE}\n\n### Instruction:\n{user}\n\n### Response:\n")
    ids = prompt + BYTES.encode(response) + [BYTES.eot_token]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids[:-1]])).double(), -1)[0]
    return sum(logp[i - 1, ids[i]].item() for i in range(len(prompt), len(ids)))


def scores(capsys, *args) -> tuple[str, float, float]:
    assert evaluate_main(list(map(str, args))) == 0
    out = capsys.readouterr().out.strip().splitlines()
    words = out[-1].split()
    return out[0], float(words[2]), float(words[5])


@pytest.fixture
def setup(tmp_path):
    torch.manual_seed(0)
    model = make_model(vocab_size=BYTES.n_vocab, context_length=256)
    checkpoint = save_checkpoint(model, tmp_path / "model.ckpt", tokenizer="byte")
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("\n".join(json.dumps(p) for p in PAIRS) + "\n")
    return model, checkpoint, pairs


def test_without_a_reference_the_margin_is_the_models_own_log_probability_margin(capsys,
                                                                                 setup):
    model, checkpoint, pairs = setup
    head, accuracy, margin = scores(capsys, "--checkpoint", checkpoint, "--preference", pairs)
    margins = [log_prob(model, p, p["chosen"]) - log_prob(model, p, p["rejected"])
               for p in PAIRS[:2]]
    assert margin == pytest.approx(sum(margins) / 2, abs=1e-3)
    assert accuracy == sum(m > 0 for m in margins) / 2
    assert "2 pairs, 1 left out" in head and "no reference" in head


def test_against_a_reference_the_margin_is_dpos(capsys, setup, tmp_path):
    """The model against itself: every margin 0, none ranked right. A preference run's
    checkpoint is measured against its init_from by default, with its beta."""
    model, checkpoint, pairs = setup
    _, accuracy, margin = scores(capsys, "--checkpoint", checkpoint, "--preference", pairs,
                                 "--reference", checkpoint)
    assert (accuracy, margin) == (0.0, 0.0)
    torch.manual_seed(1)
    moved = make_model(vocab_size=BYTES.n_vocab, context_length=256)
    tuned = save_checkpoint(moved, tmp_path / "tuned.ckpt", tokenizer="byte")
    saved = torch.load(tuned, weights_only=True)
    saved["hyper_parameters"] |= {"init_from": str(checkpoint), "dpo": {"beta": 0.5,
                                                                        "variant": "paper"}}
    torch.save(saved, tuned)
    head, accuracy, margin = scores(capsys, "--checkpoint", tuned, "--preference", pairs)
    margins = [0.5 * ((log_prob(moved, p, p["chosen"]) - log_prob(model, p, p["chosen"]))
                      - (log_prob(moved, p, p["rejected"]) - log_prob(model, p, p["rejected"])))
               for p in PAIRS[:2]]
    assert margin == pytest.approx(sum(margins) / 2, abs=1e-3)
    assert f"rewards against {checkpoint}, beta 0.5, paper" in head


def test_the_book_test_split_is_the_default_and_bad_files_are_named(capsys, setup):
    _, checkpoint, _ = setup
    assert evaluate_main(["--checkpoint", str(checkpoint), "--preference", "nope.jsonl"]) == 1
    assert "preference records nope.jsonl: no such file" in capsys.readouterr().err
    assert evaluate_main(["--checkpoint", str(checkpoint), "--preference", "--limit", "1",
                          "--reference", "none"]) == 0
    assert "the test split of book (110 pairs)" in capsys.readouterr().out
