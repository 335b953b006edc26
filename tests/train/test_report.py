"""The report a finished run prints: its numbers, its files and the commands that come next."""

from pathlib import Path

import torch
from helpers import png_size, tiny_args

from gptmini.analysis.curves import load_metrics
from gptmini.train.command import main
from gptmini.train.report import format_report


def test_report_names_last_and_best_validation_and_the_next_commands(tmp_path):
    metrics = {"val/loss": ([10, 20, 30], [5.0, 4.2, 4.5]),
               "val/bpb": ([10, 20, 30], [2.5, 2.1, 2.25])}
    (tmp_path / "checkpoints").mkdir()
    for name in ("last.ckpt", "best.ckpt"):
        (tmp_path / "checkpoints" / name).write_bytes(b"")
    text = format_report(run_name="demo", steps=30, first_step=10, seconds=125.0,
                         tokens=20_480, metrics=metrics, val_batches=20,
                         checkpoints=tmp_path / "checkpoints", curves=tmp_path / "curves.png",
                         prompt="JULIET's nurse:")
    lines = text.splitlines()
    assert lines[0] == ("run demo: 30 steps (steps 10 to 30 in this session) in 2 min 05 s, "
                        "20,480 tokens (164 tokens/s)")
    assert "last  loss 4.500  bpb 2.250  (after step 30; 20 batches" in lines[1]
    assert "best  loss 4.200  bpb 2.100  (after step 20)" in lines[2]
    assert str(tmp_path / "checkpoints" / "best.ckpt") in lines[3]
    assert lines[4].endswith("curves.png")
    generate, serve, evaluate = lines[-3:]
    assert "generate.py --checkpoint" in generate and "'JULIET'\\''s nurse:'" in generate
    assert "serve.py --checkpoint" in serve and serve.endswith("last.ckpt")
    assert "evaluate.py --checkpoint" in evaluate and evaluate.endswith("best.ckpt")


def test_an_rl_runs_report_and_curves_show_its_rollouts(tmp_path, monkeypatch):
    """GRPO's diagnostics, first -> last in the report and a panel of their own in the
    curves, so a run that is not learning says so (issue 56 item 4)."""
    from gptmini.analysis import curves

    metrics = {"val/loss": ([10, 20], [0.5, 0.4]), "val/pass_at_1": ([10, 20], [0.2, 0.35]),
               "train/reward": ([5, 10, 20], [0.1, 0.2, 0.45]),
               "train/zero_variance": ([5, 10, 20], [0.5, 0.25, 0.125]),
               "train/response_length": ([5, 10, 20], [6.0, 5.5, 4.25]),
               "train/clip_fraction": ([5, 10, 20], [0.0, 0.01, 0.03])}
    text = format_report(run_name="grpo", steps=20, first_step=0, seconds=10.0, tokens=1,
                         metrics=metrics, val_batches=2, checkpoints=tmp_path,
                         curves=tmp_path / "curves.png")
    assert ("rollouts     reward 0.10 -> 0.45, zero-variance groups 0.50 -> 0.12, response "
            "tokens 6.0 -> 4.2, clip fraction 0.00 -> 0.03 (first -> last logged)") in text
    run = tmp_path / "run" / "logs" / "version_0"
    run.mkdir(parents=True)
    rows = ["step,train/loss,train/reward,train/zero_variance,train/response_length,"
            "train/clip_fraction,train/lr"]
    rows += [f"{s},{1 - s / 40},{s / 40},{1 - s / 20},{8 - s / 5},{s / 100},0.001"
             for s in range(1, 21)]
    (run / "metrics.csv").write_text("\n".join(rows) + "\n")
    drawn = []
    monkeypatch.setattr(curves, "save_png", lambda fig, out: drawn.append(fig) or out)
    curves.plot_curves(tmp_path / "run", tmp_path / "curves.png")
    labels = [ax.get_ylabel() for ax in drawn[0].axes]
    assert labels[:4] == ["loss", "val bits per byte", "share", "learning rate"]
    assert "response tokens" in labels  # the rollouts panel's right-hand axis
    lines = {line.get_label() for ax in drawn[0].axes for line in ax.get_lines()}
    assert {"zero-variance groups", "clip fraction"} <= lines


def test_a_classifiers_report_shows_accuracy_and_suggests_evaluate_py_only(tmp_path):
    """Before: a classifier's run suggested generate.py and serve.py, which answer its class
    ids as text."""
    metrics = {"val/loss": ([10, 20], [0.9, 0.7]), "val/acc": ([10, 20], [0.55, 0.625])}
    text = format_report(run_name="genres", steps=20, first_step=0, seconds=10.0, tokens=1,
                         metrics=metrics, val_batches=4, checkpoints=tmp_path,
                         curves=tmp_path / "curves.png", generates_text=False)
    assert "last  loss 0.700  acc 0.625  (after step 20" in text
    following = text.split("\nnext\n")[1].splitlines()
    assert following and all("evaluate.py --checkpoint" in line for line in following)


def test_a_finished_run_prints_its_report_and_saves_it_with_the_curves(tmp_path, corpus,
                                                                      capsys):
    assert main(tiny_args(tmp_path, corpus, "--trainer.max_steps", "25")) == 0
    out = capsys.readouterr().out
    run = tmp_path / "runs" / "tiny"
    report = (run / "report.txt").read_text()
    assert report.strip() in out
    assert report.startswith("run tiny: 25 steps in ")
    assert ", 1,600 tokens (" in report.splitlines()[0]  # 25 steps of 4 x 16 tokens
    assert "(after step 25; 4 batches" in report  # validated at 10, 20 and the last step
    assert png_size(Path(run / "curves.png")) == (800, 800)
    assert "evaluate.py --checkpoint" in report
    # The run ends with its final weights validated. Before: a run of 1,150 steps validating
    # every 200 never scored its last 150 steps; its report, best.ckpt and the page stopped
    # at step 1,000, and the curves said 999.
    steps, losses = load_metrics(run)[0]["val/loss"]
    assert steps == [10, 20, 25]  # steps taken, as the report and the checkpoints count
    last, best = (torch.load(run / "checkpoints" / f"{n}.ckpt", weights_only=False)
                  for n in ("last", "best"))
    assert last["global_step"] == 25
    assert best["global_step"] == steps[losses.index(min(losses))]
    # the next generate.py is shown with the corpus's own words, not Shakespeare's "ROMEO:"
    prompt = report.split("--prompt '")[1].split("' --stream")[0]
    assert prompt != "ROMEO:" and prompt in corpus.read_text()

