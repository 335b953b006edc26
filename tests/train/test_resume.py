"""Exact resume on real runs: workers, accumulation, DDP ranks, kills right after a save,
signals, changed settings, and never writing over another run's checkpoints."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from helpers import HANG_SECONDS, read_metrics, tiny_args, write_corpus
from lightning.pytorch import Callback

from gptmini.data import Corpus, GPTDataModule, Loader, Windows
from gptmini.train.callbacks import RunInterrupted
from gptmini.train.command import build_cli, fit, main
from gptmini.train.optim import lr_factor

REPO = Path(__file__).resolve().parents[2]


class StopAt(Callback):
    """Simulates a run that dies after `step` optimizer steps."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step >= self.step:
            trainer.should_stop = True


def final_weights(tmp_path, corpus, name: str, stop_at: int | None = None, resume=False):
    args = tiny_args(tmp_path, corpus, "--run_name", name, "--model.drop_rate", "0.1",
                     "--trainer.max_steps", "24", "--checkpoint_every", "1",
                     "--trainer.val_check_interval", "8")
    if resume:
        args += ["--ckpt_path", "last"]
    cli = build_cli(args)
    if stop_at is not None:
        cli.trainer.callbacks.append(StopAt(stop_at))
    fit(cli)
    return cli.trainer.global_step, {k: v.clone() for k, v in cli.model.state_dict().items()}


@pytest.mark.slow
def test_resume_continues_exactly(tmp_path):
    """12 steps + resume + 12 steps gives the weights of 24 steps straight.

    Dropout is on (RNG state), the schedule is mid-cosine, and the 24 steps cross an
    epoch boundary of the data (checked: between 12 and 24 batches per epoch).
    """
    corpus = write_corpus(tmp_path / "corpus.txt", repeats=4)
    module = GPTDataModule(Corpus(str(corpus), val_fraction=0.1, cache_dir=str(tmp_path / "cache")),
                           Windows(max_length=16), Loader(batch_size=4))
    module.prepare_data()
    module.setup("fit")
    assert 12 < len(module.train_dataloader()) < 24
    steps, straight = final_weights(tmp_path, corpus, "straight")
    assert steps == 24
    steps, _ = final_weights(tmp_path, corpus, "resumed", stop_at=12)
    assert steps == 12
    steps, resumed = final_weights(tmp_path, corpus, "resumed", resume=True)
    assert steps == 24
    for key, value in straight.items():
        torch.testing.assert_close(resumed[key], value, rtol=0, atol=0, msg=key)


@pytest.mark.slow
def test_interrupted_save_leaves_the_previous_last_checkpoint(tmp_path, corpus, monkeypatch):
    cli = build_cli(tiny_args(tmp_path, corpus, "--trainer.max_steps", "10"))
    fit(cli)
    last = tmp_path / "runs" / "tiny" / "checkpoints" / "last.ckpt"
    before = last.read_bytes()

    def dies_midway(obj, f, *args, **kwargs):
        f.write(b"partial checkpoint bytes")
        raise KeyboardInterrupt  # a kill while the checkpoint is being written

    monkeypatch.setattr(torch, "save", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        cli.trainer.save_checkpoint(last)
    assert last.read_bytes() == before
    monkeypatch.undo()
    assert torch.load(last, weights_only=True)["global_step"] == 10


@pytest.mark.slow
def test_resuming_with_a_different_model_shape_is_refused(tmp_path, corpus, capsys):
    assert main(tiny_args(tmp_path, corpus, "--trainer.max_steps", "10")) == 0
    code = main(tiny_args(tmp_path, corpus, "--model.emb_dim", "64", "--ckpt_path", "last"))
    assert code == 1
    err = capsys.readouterr().err
    assert "different model (emb_dim=32 there, 64 here)" in err


def weights_of(cli) -> dict:
    return {k: v.detach().clone() for k, v in cli.model.state_dict().items()}


def assert_same_weights(a: dict, b: dict):
    for key, value in a.items():
        torch.testing.assert_close(b[key], value, rtol=0, atol=0, msg=key)


def build(tmp_path, corpus, name, *extra, resume=False, callbacks=()):
    args = tiny_args(tmp_path, corpus, "--run_name", name, "--model.drop_rate", "0.1",
                     "--checkpoint_every", "1", "--trainer.val_check_interval", "8", *extra)
    if resume:
        args += ["--ckpt_path", "last"]
    cli = build_cli(args)
    for callback in callbacks:
        cli.trainer.callbacks.insert(0, callback)  # before gptmini's own: they see its effect
    return cli


SCENARIOS = {
    "workers": ["--data.loader.num_workers", "2", "--trainer.max_steps", "16"],
    "accumulation": ["--trainer.accumulate_grad_batches", "2", "--trainer.max_steps", "10"],
    "muon, accumulation": ["--model.optimizer", "muon", "--trainer.accumulate_grad_batches",
                           "2", "--trainer.max_steps", "10"],
}


@pytest.mark.slow
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_stop_and_resume_equals_one_straight_run(tmp_path, corpus, scenario):
    """Before: with 2 workers the dropout stream diverged after a resume (1.7e-2 in 40 steps)."""
    extra = SCENARIOS[scenario]
    total = int(extra[-1])
    straight = build(tmp_path, corpus, "straight", *extra)
    fit(straight)
    first = build(tmp_path, corpus, "resumed", *extra, callbacks=[StopAt(total // 2)])
    fit(first)
    assert first.trainer.global_step == total // 2
    second = build(tmp_path, corpus, "resumed", *extra, resume=True)
    fit(second)
    assert second.trainer.global_step == straight.trainer.global_step == total
    assert_same_weights(weights_of(straight), weights_of(second))


KILLED_AFTER_FIRST_SAVE = textwrap.dedent("""
    import os, sys
    import gptmini.checkpoint.atomic as io
    from gptmini.train.command import main

    real = io.atomic_save
    def atomic_save(obj, path):
        real(obj, path)
        os._exit(9)  # a kill right after the save
    io.atomic_save = atomic_save
    main(sys.argv[1:])
""")


@pytest.mark.slow
def test_a_kill_right_after_a_resumed_runs_first_save_loses_nothing(tmp_path, corpus):
    """Before: a resumed run re-saved last.ckpt mid-accumulation, one micro-batch ahead, and a
    kill after that save dropped the micro-batch's gradient (1.5e-2)."""
    extra = ["--trainer.accumulate_grad_batches", "2", "--trainer.max_steps", "8"]
    straight = build(tmp_path, corpus, "straight", *extra)
    fit(straight)
    fit(build(tmp_path, corpus, "killed", *extra, callbacks=[StopAt(3)]))
    args = tiny_args(tmp_path, corpus, "--run_name", "killed", "--model.drop_rate", "0.1",
                     "--checkpoint_every", "1", "--trainer.val_check_interval", "8", *extra,
                     "--ckpt_path", "last")
    # The killed run computes step 4 in its own process: with this process's thread count,
    # as a user's resume has. Pinned to 1 thread (as it was) it differed by ~1e-8 from the
    # straight run at 2: MKL splits a long matmul reduction (the head's input gradient,
    # K = vocabulary) across threads and adds the partial sums in another order.
    proc = subprocess.run([sys.executable, "-c", KILLED_AFTER_FIRST_SAVE, *args], cwd=REPO,
                          capture_output=True, text=True, timeout=HANG_SECONDS,
                          env={**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())})
    assert proc.returncode == 9, proc.stderr[-2000:]
    last = tmp_path / "runs" / "killed" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 4  # a whole step, not 3.5
    resumed = build(tmp_path, corpus, "killed", *extra, resume=True)
    fit(resumed)
    assert_same_weights(weights_of(straight), weights_of(resumed))


class SignalAt(Callback):
    """Sends `signum` to this process after micro-batch `batch` (counted from 1) of the run."""

    def __init__(self, batch: int, signum: int = signal.SIGTERM, rank: int | None = None):
        self.batch, self.signum, self.rank, self.seen = batch, signum, rank, 0

    def on_train_batch_end(self, trainer, *args):
        self.seen += 1
        if self.seen == self.batch and self.rank in (None, trainer.global_rank):
            os.kill(os.getpid(), self.signum)


@pytest.mark.slow
@pytest.mark.parametrize(("grace", "stops_at"), [(60.0, 3), (0.0, 2)])
def test_a_signal_mid_accumulation_finishes_the_step_or_falls_back_to_the_last_one(
    tmp_path, corpus, grace, stops_at
):
    """4 micro-batches a step; the signal comes after micro-batch 10, half-way into step 3.
    With time to spare the step is finished; without, the run keeps step 2 and replays."""
    extra = ["--trainer.accumulate_grad_batches", "4", "--trainer.max_steps", "5",
             "--stop_grace", str(grace)]
    straight = build(tmp_path, corpus, "straight", *extra)
    fit(straight)
    stopped = build(tmp_path, corpus, "signal", *extra, callbacks=[SignalAt(10)])
    with pytest.raises(RunInterrupted) as interrupted:
        fit(stopped, own_signals=True)  # as train.py: the SIGTERM is not handed on
    assert interrupted.value.step == stops_at and interrupted.value.exit_code == 128 + 15
    last = tmp_path / "runs" / "signal" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == stops_at
    assert signal.getsignal(signal.SIGTERM) is not stopped.trainer.callbacks  # handed back
    resumed = build(tmp_path, corpus, "signal", *extra, resume=True)
    fit(resumed)
    assert resumed.trainer.global_step == 5
    assert_same_weights(weights_of(straight), weights_of(resumed))


@pytest.mark.slow
def training_until_signalled(tmp_path, corpus, *extra: str):
    """train.py in a subprocess that trains until a signal stops it, returned with its
    arguments once it has logged a training loss (the last 6 arguments set the endless run)."""
    args = tiny_args(tmp_path, corpus, *extra, "--trainer.max_steps", "100000",
                     "--checkpoint_every", "100000", "--trainer.val_check_interval", "100000")
    proc = subprocess.Popen([sys.executable, str(REPO / "train.py"), *args], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    metrics = tmp_path / "runs" / "tiny" / "logs" / "version_0" / "metrics.csv"
    deadline = time.monotonic() + HANG_SECONDS  # a hang guard, not a speed test
    try:
        while not (metrics.is_file() and "train/loss" in metrics.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.1)
    except BaseException:
        proc.kill()
        raise
    return proc, args


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_train_py_saves_and_exits_128_plus_the_signal(tmp_path, corpus, signum):
    """Before: SIGTERM ended the run with exit code 0 and no checkpoint; Ctrl-C saved none."""
    proc, args = training_until_signalled(tmp_path, corpus)
    try:
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=HANG_SECONDS)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signum, err[-2000:]
    name = signal.Signals(signum).name
    assert f"stopped by {name} at step" in err and "Traceback" not in err
    step = int(err.split(" at step ")[1].split(";")[0])
    last = tmp_path / "runs" / "tiny" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == step > 0
    assert main([*args[:-6], "--trainer.max_steps", str(step + 2), "--ckpt_path", "last"]) == 0


DDP_RUN = textwrap.dedent("""
    import os, signal, sys, torch
    from lightning.pytorch import Callback
    from gptmini.train.callbacks import RunInterrupted
    from gptmini.train.command import build_cli, fit

    class SignalRankOne(Callback):  # only rank 1 is told; both must stop at the same step
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_rank == 1 and trainer.global_step == 3:
                os.kill(os.getpid(), signal.SIGTERM)

    out, mode, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    cli = build_cli(args)
    if mode == "signal":
        cli.trainer.callbacks.insert(0, SignalRankOne())
    try:
        fit(cli, own_signals=True)  # as train.py: the SIGTERM is not handed on
        code = 0
    except RunInterrupted as stop:
        code = stop.exit_code
    rank = cli.trainer.global_rank
    torch.save({"step": cli.trainer.global_step, "code": code,
                "weights": cli.model.state_dict()}, f"{out}/{mode}-rank{rank}.pt")
""")


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_two_ddp_ranks_stop_together_and_resume_exactly(tmp_path, optimizer):
    """Before: only rank 0's random state was saved and restored on every rank, so with
    dropout 3 steps + resume + 3 steps differed from 6 straight. Muon orthogonalizes the
    all-reduced gradient: both ranks hold the same weights."""
    corpus = tmp_path / "numbers.txt"
    corpus.write_text(" ".join(str(i) for i in range(3000)))
    script = tmp_path / "ddp_run.py"
    script.write_text(DDP_RUN)
    base = tiny_args(tmp_path, corpus, "--trainer.max_steps", "6", "--trainer.devices", "2",
                     "--trainer.strategy", "ddp", "--model.drop_rate", "0.1",
                     "--checkpoint_every", "100", "--data.windows.stride", "4",
                     "--model.optimizer", optimizer)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": "29541"}

    def run(mode, *extra):
        proc = subprocess.run([sys.executable, str(script), str(tmp_path), mode, *base, *extra],
                              cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=HANG_SECONDS)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return [torch.load(tmp_path / f"{mode}-rank{r}.pt", weights_only=True) for r in (0, 1)]

    straight = run("straight", "--run_name", "straight")
    stopped = run("signal", "--run_name", "resumed")
    assert [r["code"] for r in stopped] == [128 + 15] * 2
    assert stopped[0]["step"] == stopped[1]["step"] in (3, 4)
    resumed = run("resume", "--run_name", "resumed", "--ckpt_path", "last")
    for rank in (0, 1):
        assert resumed[rank]["step"] == 6
        assert_same_weights(straight[rank]["weights"], resumed[rank]["weights"])
    assert_same_weights(resumed[0]["weights"], resumed[1]["weights"])


@pytest.mark.slow
def test_changed_optimization_settings_apply_on_resume_and_are_named(tmp_path, corpus, capsys):
    """Before: a new --model.learning_rate on resume was ignored while hparams.yaml said it
    was used."""
    extra = ["--trainer.max_steps", "4", "--model.warmup_steps", "2"]
    assert main(tiny_args(tmp_path, corpus, *extra)) == 0
    changed = ["--trainer.max_steps", "8", "--model.learning_rate", "5e-4",
               "--model.weight_decay", "0.05", "--ckpt_path", "last"]
    cli = build_cli(tiny_args(tmp_path, corpus, *extra, *changed))
    fit(cli)
    out = capsys.readouterr().out
    assert "learning_rate 0.003 -> 0.0005" in out and "weight_decay 0.1 -> 0.05" in out
    steps, lrs = read_metrics_column(tmp_path / "runs" / "tiny", "train/lr")
    resumed = [(s, lr) for s, lr in zip(steps, lrs, strict=True) if s >= 4]
    assert [s for s, _ in resumed] == [4, 5, 6, 7]
    for step, lr in resumed:  # the CSV row `step` holds the rate optimizer step `step` used
        assert lr == pytest.approx(5e-4 * lr_factor(step, 2, 8, 0.1))
    groups = cli.trainer.optimizers[0].param_groups
    assert groups[0]["weight_decay"] == 0.05 and groups[1]["weight_decay"] == 0.0


def read_metrics_column(run: Path, key: str) -> tuple[list[int], list[float]]:
    rows = [r for r in read_metrics(run) if r.get(key) not in (None, "")]
    return [int(r["step"]) for r in rows], [float(r[key]) for r in rows]


def test_a_new_run_never_writes_over_another_runs_checkpoints(tmp_path, corpus, capsys):
    """Before: reusing --run_name without --ckpt_path overwrote the first run's best.ckpt."""
    assert main(tiny_args(tmp_path, corpus, "--trainer.max_steps", "10")) == 0
    capsys.readouterr()
    checkpoints = tmp_path / "runs" / "tiny" / "checkpoints"
    before = {p.name: p.read_bytes() for p in checkpoints.iterdir()}
    assert set(before) == {"last.ckpt", "best.ckpt"}
    assert main(tiny_args(tmp_path, corpus, "--trainer.max_steps", "20")) == 1
    err = capsys.readouterr().err
    assert "already has checkpoints" in err and "--ckpt_path last" in err
    assert "another --run_name" in err and "Traceback" not in err
    assert {p.name: p.read_bytes() for p in checkpoints.iterdir()} == before


class EarlyStopAt(Callback):
    """Stops the run at the validation of optimizer step `step`, as EarlyStopping does."""

    def __init__(self, step: int):
        self.step = step

    def on_validation_end(self, trainer, *args):
        if trainer.global_step == self.step:
            trainer.should_stop = True


ENDINGS = {  # how the first run ends: the extra arguments and callbacks of each
    "max_steps": (["--trainer.max_steps", "11"], []),
    "max_epochs": (["--trainer.max_steps", "-1", "--trainer.max_epochs", "1"], []),
    "early_stop": ([], [EarlyStopAt(8)]),
}


@pytest.mark.slow
@pytest.mark.parametrize("ending", ENDINGS)
def test_a_finished_run_saves_its_final_step(tmp_path, ending):
    """Before: a run that ended between two --checkpoint_every saves lost its last steps
    (last.ckpt at step 10 of 11 here), and nothing said so. The final last.ckpt holds the
    final weights and resumes; an early stop (whose schedule does not depend on where it
    stopped) resumes to the weights of one straight run."""
    corpus = write_corpus(tmp_path / "corpus.txt", repeats=4)
    extra, callbacks = ENDINGS[ending]
    common = ["--checkpoint_every", "5", "--trainer.max_steps", "24"]
    first = build(tmp_path, corpus, "ended", *common, *extra, callbacks=callbacks)
    fit(first)
    ended_at = first.trainer.global_step
    assert ended_at % 5 and 5 < ended_at < 24
    last = tmp_path / "runs" / "ended" / "checkpoints" / "last.ckpt"
    saved = torch.load(last, weights_only=True)
    assert saved["global_step"] == ended_at
    assert_same_weights(weights_of(first), saved["state_dict"])
    resumed = build(tmp_path, corpus, "ended", *common, resume=True)
    fit(resumed)
    assert resumed.trainer.global_step == 24
    if ending == "early_stop":
        straight = build(tmp_path, corpus, "straight", *common)
        fit(straight)
        assert_same_weights(weights_of(straight), weights_of(resumed))


@pytest.mark.slow
def test_two_sigterms_50_ms_apart_exit_143_and_leave_a_whole_checkpoint(tmp_path, corpus):
    """Before: the second signal, landing in the first one's save, exited 1 with a
    RuntimeError from the checkpoint writer."""
    proc, _ = training_until_signalled(tmp_path, corpus, "--model.emb_dim", "256",
                                       "--model.n_heads", "4")
    try:
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=HANG_SECONDS)
    finally:
        proc.kill()
    assert proc.returncode == 143 and "Traceback" not in err, err[-3000:]
    assert "SIGTERM" in err.splitlines()[-1]
    last = tmp_path / "runs" / "tiny" / "checkpoints" / "last.ckpt"
    if last.exists():  # the first signal's save, if it finished before the second
        assert torch.load(last, weights_only=True)["global_step"] > 0


def test_a_different_tokenizer_on_resume_is_named_as_overridden(tmp_path, corpus, capsys):
    """Before: a resume with another --model.tokenizer ran on with the checkpoint's
    vocabulary and said nothing."""
    assert main(tiny_args(tmp_path, corpus, "--trainer.max_steps", "2")) == 0
    same = build_cli(tiny_args(tmp_path, corpus, "--trainer.max_steps", "3", "--ckpt_path",
                               "last"))
    assert "overridden" not in capsys.readouterr().out
    other = build_cli(tiny_args(tmp_path, corpus, "--trainer.max_steps", "3", "--model.tokenizer",
                                "byte", "--ckpt_path", "last"))
    out = capsys.readouterr().out
    assert "--model.tokenizer byte is overridden by the checkpoint's vocabulary (gpt2" in out
    assert other.model.hparams.tokenizer == same.model.hparams.tokenizer == "gpt2"
    fit(other)
    assert other.trainer.global_step == 3


@pytest.mark.slow
def test_another_corpus_names_its_run_and_a_trial_run_saves_nothing(tmp_path, corpus, capsys):
    """Before: after the default run, `train.py --data.corpus.source notes.txt` and
    `--trainer.fast_dev_run true` were both refused (the run kept its config's name, whose
    checkpoints were there), with advice to resume; a trial under a new name wrote a
    checkpoint that used the name up."""
    first = tiny_args(tmp_path, corpus, "--trainer.max_steps", "4")
    assert main(first) == 0
    tiny = tmp_path / "runs" / "tiny"
    before = {p.name: p.read_bytes() for p in (tiny / "checkpoints").iterdir()}
    report = (tiny / "report.txt").read_text()
    assert main([*first, "--trainer.fast_dev_run", "true"]) == 0
    assert {p.name: p.read_bytes() for p in (tiny / "checkpoints").iterdir()} == before
    assert (tiny / "report.txt").read_text() == report
    capsys.readouterr()

    notes = write_corpus(tmp_path / "notes.txt", repeats=12)
    unnamed = [a for a in tiny_args(tmp_path, notes, "--trainer.max_steps", "4")
               if a not in ("--run_name", "tiny")]
    assert main(unnamed) == 0
    assert "run name: notes (after the corpus" in capsys.readouterr().out
    assert (tmp_path / "runs" / "notes" / "checkpoints" / "last.ckpt").is_file()

    assert main(unnamed) == 1  # the same corpus again: resume it, or name a fresh start
    err = capsys.readouterr().err
    assert "it trained on this corpus. Resume it with --ckpt_path last" in err
    assert main([*unnamed, "--run_name", "tiny"]) == 1  # another corpus: a name of its own
    err = capsys.readouterr().err
    assert f"it trained on {corpus}, and this run is on {notes}" in err
    assert err.rstrip().endswith("e.g. --run_name notes") and "--ckpt_path" not in err
