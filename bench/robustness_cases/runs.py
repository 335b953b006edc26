"""A run's checkpoints through what happens to runs: a second run on the same name, resumes
(changed settings, workers, accumulation, DDP ranks: exact or not), signals, kills in the
middle of a save, a full disk, and the steps after the last periodic save."""

import csv
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from robustness_cases.lab import Lab, last_line, outcome

# Stop a run after `step` optimizer steps from Python (old and new trees have these names).
STOP_AT = """
import sys
from lightning.pytorch import Callback
from gptmini.train.command import build_cli, fit
class StopAt(Callback):
    def __init__(self, step): self.step = step
    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step >= self.step: trainer.should_stop = True
step, args = int(sys.argv[1]), sys.argv[2:]
cli = build_cli(args)
if step: cli.trainer.callbacks.append(StopAt(step))
fit(cli)
"""


def weights(path: Path) -> dict:
    import torch

    return torch.load(path, weights_only=True, map_location="cpu")["state_dict"]


def max_difference(a: Path, b: Path) -> float:
    wa, wb = weights(a), weights(b)
    return max(float((wa[k].float() - wb[k].float()).abs().max()) for k in wa)


def final_steps_saved(lab: Lab):
    """10 steps with a checkpoint every 4: last.ckpt must hold step 10, not 8."""
    import torch

    where = lab.folder()
    proc = lab.run("train.py", *lab.args(where, "--trainer.max_steps", "10"), cwd=where)
    last = where / "runs" / "r" / "checkpoints" / "last.ckpt"
    if proc.returncode or not last.is_file():
        return outcome(proc), last_line(proc)
    step = torch.load(last, weights_only=True, map_location="cpu")["global_step"]
    return ("ok" if step == 10 else "data lost"), f"last.ckpt at step {step} of 10"


def reuse_run_name(lab: Lab):
    where = lab.folder()
    first = lab.run("train.py", *lab.args(where), cwd=where)
    best = where / "runs" / "r" / "checkpoints" / "best.ckpt"
    if first.returncode or not best.is_file():
        return outcome(first), last_line(first)
    before = best.read_bytes()
    again = lab.run("train.py", *lab.args(where, "--model.learning_rate", "1e-1"), cwd=where)
    if best.read_bytes() != before:
        return "data lost", "the first run's best.ckpt was overwritten"
    return outcome(again), last_line(again)


def concurrent_same_run_name(lab: Lab):
    """Two train.py on one --run_name at once: the second must refuse while the first lives."""
    where = lab.folder()
    args = lab.args(where, "--trainer.max_steps", "100000", "--checkpoint_every", "100000",
                    "--trainer.val_check_interval", "100000")
    first = subprocess.Popen([sys.executable, str(lab.tree / "train.py"), *args], cwd=where,
                             env=lab.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        metrics = where / "runs" / "r" / "logs" / "version_0" / "metrics.csv"
        deadline = time.monotonic() + 120
        while not metrics.is_file() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        second = lab.run("train.py", *args, "--ckpt_path", "last", cwd=where, timeout=300)
    finally:
        first.terminate()
        first.wait(timeout=120)
    result = outcome(second)
    return ("silent" if result == "ok" else result), last_line(second)


def resume_changed_lr(lab: Lab):
    where = lab.folder()
    lab.run("train.py", *lab.args(where), cwd=where)
    proc = lab.run("train.py", *lab.args(where, "--trainer.max_steps", "12",
                                         "--model.learning_rate", "1e-5", "--ckpt_path", "last"),
                   cwd=where)
    lrs = []
    for path in sorted((where / "runs" / "r" / "logs").glob("version_*/metrics.csv")):
        with open(path) as f:
            lrs += [float(r["train/lr"]) for r in csv.DictReader(f)
                    if r.get("train/lr") and int(r["step"]) >= 8]
    if proc.returncode == 0 and lrs and max(lrs) > 1e-5:
        return "silent", f"logged lr after resume {max(lrs):.2e}, asked for 1e-5"
    return outcome(proc), last_line(proc)


def resume_other_tokenizer(lab: Lab):
    where = lab.folder()
    lab.run("train.py", *lab.args(where, "--model.tokenizer", "gpt2"), cwd=where)
    proc = lab.run("train.py", *lab.args(where, "--trainer.max_steps", "10", "--model.tokenizer",
                                         "byte", "--ckpt_path", "last"), cwd=where)
    said = "overridden" in proc.stdout + proc.stderr
    result = outcome(proc)
    return ("silent" if result == "ok" and not said else result), (
        "said overridden" if said else last_line(proc))


def resume_exactly(extra: list[str], ranks: int = 1, total: int = 12):
    """Stop at half, resume, compare with one straight run: any difference is silent."""

    def case(lab: Lab):
        where = lab.folder()
        script = where / "stop_at.py"
        script.write_text(STOP_AT)
        corpus = where / "numbers.txt"
        corpus.write_text(" ".join(str(i) for i in range(3000)))
        common = [*extra, "--model.drop_rate", "0.1", "--checkpoint_every", "1",
                  "--trainer.max_steps", str(total), "--trainer.val_check_interval", "4",
                  "--data.windows.stride", "4"]
        if ranks > 1:
            common += ["--trainer.devices", str(ranks), "--trainer.strategy", "ddp"]
        env_port = {"MASTER_PORT": str(29600 + lab.n)}

        def go(name, step, *more):
            return subprocess.run(
                [sys.executable, str(script), str(step),
                 *lab.args(where, *common, "--run_name", name, *more, source=corpus)],
                cwd=where, env={**lab.env, **env_port}, capture_output=True, text=True,
                timeout=900)

        for proc in (go("straight", 0), go("halves", total // 2),
                     go("halves", 0, "--ckpt_path", "last")):
            if proc.returncode:
                return outcome(proc), last_line(proc)
        ckpts = [where / "runs" / n / "checkpoints" / "last.ckpt" for n in ("straight", "halves")]
        difference = max_difference(*ckpts)
        return ("ok" if difference == 0 else "silent"), f"max |difference| {difference:.1e}"

    return case


def training_until_signalled(lab: Lab, where: Path, *extra: str) -> subprocess.Popen:
    """train.py training until a signal stops it, returned once it has logged a training
    loss (or ended, or 120 s passed)."""
    args = lab.args(where, *extra, "--trainer.max_steps", "100000", "--checkpoint_every",
                    "100000", "--trainer.val_check_interval", "100000")
    proc = subprocess.Popen([sys.executable, str(lab.tree / "train.py"), *args], cwd=where,
                            env=lab.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    metrics = where / "runs" / "r" / "logs" / "version_0" / "metrics.csv"
    deadline = time.monotonic() + 120
    while not (metrics.is_file() and "train/loss" in metrics.read_text()):
        if proc.poll() is not None or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return proc


def signal_case(signum: int):
    def case(lab: Lab):
        where = lab.folder()
        proc = training_until_signalled(lab, where)
        proc.send_signal(signum)
        try:
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            return "traceback", "did not stop"
        saved = (where / "runs" / "r" / "checkpoints" / "last.ckpt").is_file()
        detail = f"exit {proc.returncode}, checkpoint {'saved' if saved else 'none'}"
        if "Traceback (most recent call last)" in err:
            return "traceback", detail
        if proc.returncode == 128 + signum and saved:
            return "ok", detail
        return "silent", detail  # work since the last periodic save is gone

    return case


def two_sigterms(lab: Lab):
    where = lab.folder()
    proc = training_until_signalled(lab, where, "--model.emb_dim", "256", "--model.n_heads", "4")
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    if "Traceback (most recent call last)" in err:
        return "traceback", f"exit {proc.returncode}"
    return ("ok" if proc.returncode == 143 else "silent"), f"exit {proc.returncode}"


def kill_mid_save(lab: Lab):
    """The issue's reproduction: $TMPDIR on another filesystem, kill -9 during a save."""
    where = lab.folder()
    staging = Path("/dev/shm") / f"gptmini-robustness-{os.getpid()}"
    staging.mkdir(exist_ok=True)
    args = lab.args(where, "--trainer.max_steps", "60", "--checkpoint_every", "1",
                    "--model.emb_dim", "256", "--model.n_heads", "4", "--model.n_layers", "4")
    env = {**lab.env, "TMPDIR": str(staging)}
    last = where / "runs" / "r" / "checkpoints" / "last.ckpt"
    full_size, killed = 0, 0
    for _attempt in range(3):
        proc = subprocess.Popen([sys.executable, str(lab.tree / "train.py"), *args,
                                 "--ckpt_path", "last"], cwd=where, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            size = last.stat().st_size if last.is_file() else 0
            full_size = max(full_size, size)
            if 0 < full_size and size < full_size:  # caught mid-copy, as in the issue
                break
            time.sleep(0.001)
        proc.kill()
        proc.wait()
        killed += 1
    leaked = sum(p.stat().st_size for p in staging.rglob("*") if p.is_file()
                 and "torchinductor" not in str(p))  # torch keeps a cache folder there too
    shutil.rmtree(staging)
    resume = lab.run("train.py", *args, "--ckpt_path", "last", cwd=where)
    if resume.returncode or (last.is_file() and last.stat().st_size < full_size * 0.9):
        return "data lost", (f"after {killed} kills: {last_line(resume)}; {leaked} bytes "
                             "left in $TMPDIR")
    return "ok", f"{killed} kills mid-save, resumed; {leaked} bytes left in $TMPDIR"


def file_size_limit(lab: Lab):
    import resource  # POSIX only: the other cases still import on Windows

    where = lab.folder()
    args = lab.args(where, "--model.emb_dim", "64")
    first = lab.run("train.py", *args, cwd=where)
    last = where / "runs" / "r" / "checkpoints" / "last.ckpt"
    if first.returncode or not last.is_file():
        return outcome(first), last_line(first)
    before, size = last.read_bytes(), last.stat().st_size

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (size // 2, size // 2))

    proc = lab.run("train.py", *args, "--trainer.max_steps", "16", "--ckpt_path", "last",
                   cwd=where, preexec_fn=limit)
    if not last.is_file() or last.read_bytes() != before:
        return "data lost", last_line(proc)
    return outcome(proc), last_line(proc)


def resume_after_cut_metrics(lab: Lab):
    """A run killed while its CSV logger wrote a row, then resumed: the cut row must not
    fail the resumed run at its end (before: it trained, saved, then exited 1 with "could
    not convert string to float", naming no file)."""
    where = lab.folder()
    first = lab.run("train.py", *lab.args(where), cwd=where)
    metrics = where / "runs" / "r" / "logs" / "version_0" / "metrics.csv"
    if first.returncode or not metrics.is_file():
        return outcome(first), last_line(first)
    metrics.write_text(metrics.read_text()[:-7])  # the last row cut mid-number
    proc = lab.run("train.py", *lab.args(where, "--trainer.max_steps", "12", "--ckpt_path",
                                         "last"), cwd=where)
    named = str(metrics) in proc.stderr
    if outcome(proc) == "ok" and not named:
        return "silent", "the cut row was skipped without a word"
    return outcome(proc), last_line(proc) if proc.returncode else "resumed; the cut row named"


CASES = {
    "resume after the metrics file was cut mid-row": resume_after_cut_metrics,
    "a second run under the same --run_name": reuse_run_name,
    "two train.py on one --run_name at once": concurrent_same_run_name,
    "a run ending between two checkpoints (max_steps)": final_steps_saved,
    "a new learning rate on resume": resume_changed_lr,
    "resume with another --model.tokenizer": resume_other_tokenizer,
    "resume exactly, 2 data loader workers": resume_exactly(["--data.loader.num_workers", "2"]),
    "resume exactly, gradient accumulation 2": resume_exactly(
        ["--trainer.accumulate_grad_batches", "2"]),
    "resume exactly, 2 DDP ranks with dropout": resume_exactly([], ranks=2, total=6),
    "SIGTERM (kill, docker stop)": signal_case(signal.SIGTERM),
    "Ctrl-C (SIGINT)": signal_case(signal.SIGINT),
    "two SIGTERMs 50 ms apart": two_sigterms,
    "kill -9 mid-save, $TMPDIR on tmpfs": kill_mid_save,
    "a file-size limit during a save": file_size_limit,
}
