"""Try to break gptmini as a new user would, and count what happens.

Each case runs train.py, generate.py, serve.py (one shared server, called over HTTP) or the
conformance kit (or a few lines of Python against the training command) in a fresh process,
and is classed as:
    ok            did what was asked (or refused it on purpose, where that is the answer)
    clear error   exited non-zero with one line naming the input, and no traceback
    traceback     a raw Python traceback reached the user
    silent        exited 0, but the result is wrong (data dropped, a setting ignored, ...)
    data lost     a checkpoint that existed before is gone or damaged, or steps are in none
    hang          no answer within the case's time limit

    python bench/robustness.py                    # this checkout
    python bench/robustness.py --tree /path/to/another/checkout   # e.g. an older commit

Offline throughout (HF_HUB_OFFLINE=1). Takes a few minutes on 2 cores.
"""

import argparse
import gzip
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

TINY = ["--trainer.accelerator", "cpu", "--trainer.max_steps", "8",
        "--trainer.val_check_interval", "4", "--trainer.limit_val_batches", "2",
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
        "--trainer.num_sanity_val_steps", "0", "--trainer.log_every_n_steps", "1",
        "--checkpoint_every", "4", "--sample_every", "0", "--model.context_length", "16",
        "--model.emb_dim", "32", "--model.n_heads", "2", "--model.n_layers", "2",
        "--model.warmup_steps", "2", "--model.peak_flops", "1e10", "--data.loader.batch_size", "4",
        "--data.corpus.val_fraction", "0.1"]

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


class Lab:
    """A scratch folder, a corpus, and the tree whose scripts are run."""

    def __init__(self, tree: Path, root: Path):
        self.tree, self.root, self.n = tree, root, 0
        self.env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1",
                    "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline",
                    "TIKTOKEN_CACHE_DIR": str(root / "no-tiktoken-cache")}
        lines = [f"{n} said {w} to the {t}." for n in ("Romeo", "Juliet", "Tybalt")
                 for w in ("hello", "farewell", "nothing") for t in ("moon", "sun", "night")]
        self.corpus = root / "corpus.txt"
        self.corpus.write_text("\n".join(lines * 12))

    def folder(self) -> Path:
        self.n += 1
        path = self.root / f"case{self.n}"
        path.mkdir()
        return path

    def args(self, where: Path, *extra: str, source: Path | str | None = None) -> list[str]:
        source = self.corpus if source is None else source
        return [*TINY, "--trainer.default_root_dir", str(where / "runs"), "--run_name", "r",
                "--data.corpus.cache_dir", str(where / "cache"),
                "--data.corpus.source", str(source), *extra]

    def run(self, script: str, *args: str, cwd: Path, timeout: float = 600, **kwargs):
        return subprocess.run([sys.executable, str(self.tree / script), *args], cwd=cwd,
                              env=self.env, capture_output=True, text=True, timeout=timeout,
                              **kwargs)

    def python(self, code: str, *args: str, cwd: Path):
        return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=self.env,
                              capture_output=True, text=True, timeout=600)


def outcome(proc) -> str:
    if "Traceback (most recent call last)" in proc.stderr:
        return "traceback"
    return "ok" if proc.returncode == 0 else "clear error"


def last_line(proc) -> str:
    lines = (proc.stderr or proc.stdout).strip().splitlines()
    return lines[-1][:150] if lines else ""


def weights(path: Path) -> dict:
    import torch

    return torch.load(path, weights_only=True, map_location="cpu")["state_dict"]


def max_difference(a: Path, b: Path) -> float:
    wa, wb = weights(a), weights(b)
    return max(float((wa[k].float() - wb[k].float()).abs().max()) for k in wa)


# --------------------------------------------------------------------------- the cases


def train_case(files: dict, *extra: str, source: str | None = None, expect_error=True):
    """A train.py run on files written first; an error is what is wanted (or not)."""

    def case(lab: Lab):
        where = lab.folder()
        for name, content in files.items():
            path = where / name
            if isinstance(content, bytes):
                path.write_bytes(content)
            else:
                path.write_text(content)
        src = None if source is None else source.replace("{d}", str(where))
        proc = lab.run("train.py", *lab.args(where, *extra, source=src), cwd=where)
        result = outcome(proc)
        if result == "ok" and expect_error:
            result = "silent"
        return result, last_line(proc)

    return case


def jsonl(records: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


_rng = random.Random(0)
RANDOM_WORDS = " ".join(_rng.choice(["to", "be", "or", "not", "that", "is"])
                        for _ in range(20000)).encode()  # compresses to ~7 kB, not ~100 B
GOOD = [{"text": f"Romeo said {w} to the moon, and Juliet answered."} for w in range(60)]


def missing_text(skip: bool):
    def case(lab: Lab):
        where = lab.folder()
        records = [r if i % 2 else {"body": r["text"]} for i, r in enumerate(GOOD)]
        (where / "d.jsonl").write_text(jsonl(records))
        extra = ["--data.corpus.skip_missing_text", "true"] if skip else []
        proc = lab.run("train.py", *lab.args(where, *extra, source=where / "d.jsonl"),
                       cwd=where)
        result = outcome(proc)
        said = "30 of 60" in proc.stderr + proc.stdout
        if result == "ok" and not said:
            result = "silent"  # half the records gone without a word
        return result, last_line(proc)

    return case


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


def resume_changed_lr(lab: Lab):
    where = lab.folder()
    lab.run("train.py", *lab.args(where), cwd=where)
    proc = lab.run("train.py", *lab.args(where, "--trainer.max_steps", "12",
                                         "--model.learning_rate", "1e-5", "--ckpt_path", "last"),
                   cwd=where)
    import csv

    lrs = []
    for path in sorted((where / "runs" / "r" / "logs").glob("version_*/metrics.csv")):
        with open(path) as f:
            lrs += [float(r["train/lr"]) for r in csv.DictReader(f)
                    if r.get("train/lr") and int(r["step"]) >= 8]
    if proc.returncode == 0 and lrs and max(lrs) > 1e-5:
        return "silent", f"logged lr after resume {max(lrs):.2e}, asked for 1e-5"
    return outcome(proc), last_line(proc)


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
    import resource

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


def generate_case(prepare, *extra: str):
    def case(lab: Lab):
        where = lab.folder()
        target = prepare(lab, where)
        proc = lab.run("generate.py", *extra, *(str(t) for t in target), cwd=where)
        return outcome(proc), last_line(proc)

    return case


def trained(lab: Lab, where: Path) -> Path:
    lab.run("train.py", *lab.args(where, "--trainer.max_steps", "2"), cwd=where)
    return where / "runs" / "r" / "checkpoints" / "last.ckpt"


def padded_vocab(lab: Lab, where: Path) -> list:
    code = ("import torch, sys\nfrom gptmini.model import GPTConfig, GPTModel\n"
            "m = GPTModel(GPTConfig(vocab_size=50304, context_length=32, emb_dim=16, n_heads=2,"
            " n_layers=2, drop_rate=0.0))\n"
            "with torch.no_grad(): m.out_head.weight[50257:] *= 300\n"
            "torch.save({'state_dict': {'model.' + k: v for k, v in m.state_dict().items()},"
            " 'hyper_parameters': {**m.cfg.to_dict(), 'tokenizer': 'gpt2'}}, sys.argv[1])\n")
    lab.python(code, str(where / "wide.ckpt"), cwd=where)
    return ["--checkpoint", where / "wide.ckpt", "--temperature", "5", "--num_samples", "16",
            "--max_new_tokens", "8"]


def malicious(lab: Lab, where: Path) -> list:
    code = ("import os, torch, sys\nclass X:\n    def __reduce__(self):\n"
            "        return (os.system, ('echo pwned',))\n"
            "torch.save({'state_dict': {}, 'hyper_parameters': {'x': X()}}, sys.argv[1])\n")
    lab.python(code, str(where / "evil.ckpt"), cwd=where)
    return ["--checkpoint", where / "evil.ckpt"]


def malicious_case(lab: Lab):
    result, line = generate_case(malicious)(lab)
    if result == "clear error" and "arbitrary code" not in line:
        result = "silent"  # refused, but said to be corrupt: the wrong reason
    return result, line


def truncated_hf(lab: Lab, where: Path) -> list:
    code = ("import sys\nfrom gptmini.convert import export_hf\n"
            "from gptmini.model import GPTConfig, GPTModel\n"
            "d = export_hf(GPTModel(GPTConfig(vocab_size=50257, context_length=32, emb_dim=16,"
            " n_heads=2, n_layers=2, qkv_bias=True, tie_weights=True)), sys.argv[1])\n"
            "w = d / 'model.safetensors'; w.write_bytes(w.read_bytes()[:5000])\n")
    lab.python(code, str(where / "hf"), cwd=where)
    return ["--hf", where / "hf"]


def corrupt_checkpoint(data: bytes):
    def prepare(lab, where):
        path = trained(lab, where)
        path.write_bytes(data if data else path.read_bytes()[:3000])
        return ["--checkpoint", path]

    return prepare


# --------------------------------------------------------------------------- issue 29's classes


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


def resume_other_tokenizer(lab: Lab):
    where = lab.folder()
    lab.run("train.py", *lab.args(where, "--model.tokenizer", "gpt2"), cwd=where)
    proc = lab.run("train.py", *lab.args(where, "--trainer.max_steps", "10", "--model.tokenizer",
                                         "byte", "--ckpt_path", "last"), cwd=where)
    said = "overridden" in proc.stdout + proc.stderr
    result = outcome(proc)
    return ("silent" if result == "ok" and not said else result), (
        "said overridden" if said else last_line(proc))


KIT_MODULES = """
import time, torch
from gptmini.attention import MultiHeadAttention
class NaNs(MultiHeadAttention):
    def forward(self, x): return super().forward(x) * float("nan")
class Mutates(MultiHeadAttention):
    def forward(self, x):
        out = super().forward(x); x.mul_(2); return out
class Slow(MultiHeadAttention):
    def forward(self, x):
        time.sleep(0.5); return super().forward(x)
"""


def kit_case(name: str, expected: str, *extra: str):
    """python -m gptmini.testing on a broken module: the report must say `expected`."""

    def case(lab: Lab):
        where = lab.folder()
        (where / "mods.py").write_text(KIT_MODULES)
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "gptmini.testing", f"mods:{name}", *extra],
                              cwd=where, env={**lab.env, "PYTHONPATH": f"{lab.tree}:{where}"},
                              capture_output=True, text=True, timeout=300)
        took = time.monotonic() - start
        if "Traceback (most recent call last)" in proc.stderr:
            return "traceback", last_line(proc)
        if expected not in proc.stdout:
            return "silent", f"no {expected!r} in the report ({took:.0f} s)"
        return "ok", f"said {expected!r} ({took:.0f} s)"

    return case


class Served:
    """One serve.py on a tiny checkpoint, shared by the server cases."""

    process = url = None

    @classmethod
    def start(cls, lab: Lab) -> str:
        if cls.url:
            return cls.url
        import socket

        where = lab.folder()
        code = ("import sys, torch\nfrom gptmini.model import GPTConfig, GPTModel\n"
                "torch.manual_seed(0)\n"
                "m = GPTModel(GPTConfig(vocab_size=50257, context_length=32, emb_dim=16, "
                "n_heads=2, n_layers=2, drop_rate=0.0))\n"
                "torch.save({'state_dict': {'model.' + k: v for k, v in m.state_dict().items()},"
                " 'hyper_parameters': {**m.cfg.to_dict(), 'tokenizer': 'gpt2'}}, sys.argv[1])\n")
        lab.python(code, str(where / "tiny.ckpt"), cwd=where)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        cls.process = subprocess.Popen(
            [sys.executable, str(lab.tree / "serve.py"), "--checkpoint", str(where / "tiny.ckpt"),
             "--port", str(port), "--api_key", "k", "--max_pending", "64", "--dtype", "float32",
             "--timeout", "5"],
            cwd=where, env=lab.env, stdout=subprocess.DEVNULL, stderr=open(where / "log", "w"))
        cls.log, cls.url = where / "log", f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                post(cls.url + "/health", None, method="GET")
                return cls.url
            except OSError:
                time.sleep(0.2)
        raise RuntimeError("serve.py did not start")

    @classmethod
    def stop(cls):
        if cls.process is not None:
            cls.process.terminate()
            cls.process.wait(timeout=60)


def post(url: str, body, headers=None, method="POST", raw: bytes | None = None):
    """(status, parsed JSON answer) of one HTTP call, with the standard library."""
    import urllib.error
    import urllib.request

    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={
        "content-type": "application/json", "authorization": "Bearer k", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def server_case(body, expected_status: int, param: str | None = None, headers=None):
    """One call to the shared server: the status wanted, and a 400's param named."""

    def case(lab: Lab):
        url = Served.start(lab)
        before = Served.log.read_text()
        status, text = post(url + "/v1/completions", body, headers)
        logged = Served.log.read_text()[len(before):]
        if (status >= 500 and status != expected_status) or "Traceback" in logged:
            return "traceback", f"{status}: {text[:100]}"
        if status != expected_status:
            return "silent", f"{status}, wanted {expected_status}: {text[:100]}"
        if param is not None and json.loads(text)["error"]["param"] != param:
            return "silent", f"{status}, but the error names {json.loads(text)['error']['param']}"
        return ("clear error" if 400 <= status < 500 else "ok"), f"{status} {text[:90]}"

    return case


def server_hangup(lab: Lab):
    import socket

    url = Served.start(lab)
    before = Served.log.read_text()
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer k\r\n"
                     b"content-length: 500\r\n\r\n{\"prompt")
        time.sleep(0.3)
    time.sleep(0.5)
    logged = Served.log.read_text()[len(before):]
    return ("traceback" if "Traceback" in logged else "ok"), f"{len(logged)} bytes logged"


def serve_flag(*flags: str):
    def case(lab: Lab):
        where = lab.folder()
        proc = lab.run("serve.py", "--checkpoint", str(trained(lab, where)), "--port", "0",
                       *flags, cwd=where, timeout=60)
        return ("silent" if outcome(proc) == "ok" else outcome(proc)), last_line(proc)

    return case


def batch_case(content: str | bytes, *extra: str):
    def case(lab: Lab):
        where = lab.folder()
        path = where / "b.jsonl"
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        extra_args = [e.replace("{d}", str(where)) for e in extra]
        proc = lab.run("generate.py", "--checkpoint", str(trained(lab, where)), "--batch_file",
                       str(path), *extra_args, cwd=where, timeout=120)
        result = outcome(proc)
        return ("silent" if result == "ok" else result), last_line(proc)

    return case


def binary_body(lab: Lab):
    url = Served.start(lab)
    status, text = post(url + "/v1/completions", None, raw=b"\x89PNG\x00\xff\xfe")
    if status >= 500:
        return "traceback", f"{status}"
    return ("clear error" if status == 400 else "silent"), f"{status} {text[:90]}"


GOOD_BATCH = '{"prompt": "a", "max_new_tokens": 2}\n'
ISSUE_29 = {
    # --- runs
    "a run ending between two checkpoints (max_steps)": final_steps_saved,
    "two train.py on one --run_name at once": concurrent_same_run_name,
    "two SIGTERMs 50 ms apart": two_sigterms,
    "resume with another --model.tokenizer": resume_other_tokenizer,
    # --- the server: wrong JSON types, sizes, headers, hang-ups
    "server: stream as the string false": server_case({"prompt": "a", "stream": "false"}, 400,
                                                      "stream"),
    "server: temperature true": server_case({"prompt": "a", "temperature": True}, 400,
                                            "temperature"),
    "server: max_tokens as a string": server_case({"prompt": "a", "max_tokens": "5"}, 400,
                                                  "max_tokens"),
    "server: max_tokens huge, bounded by --timeout": server_case(
        {"prompt": "a", "max_tokens": 10**30}, 504),
    "server: n 0.5": server_case({"prompt": "a", "n": 0.5}, 400, "n"),
    "server: top_k negative": server_case({"prompt": "a", "top_k": -3}, 400, "top_k"),
    "server: top_p NaN-like string": server_case({"prompt": "a", "top_p": "nan"}, 400, "top_p"),
    "server: seed 2**70": server_case({"prompt": "a", "seed": 2**70}, 400, "seed"),
    "server: stream_options a list": server_case(
        {"prompt": "a", "stream": True, "stream_options": ["include_usage"]}, 400,
        "stream_options"),
    "server: stop 5": server_case({"prompt": "a", "stop": 5}, 400, "stop"),
    "server: prompt of token ids out of range": server_case({"prompt": [10**9]}, 400, "prompt"),
    "server: echo 0": server_case({"prompt": "a", "echo": 0}, 400, "echo"),
    "server: a body that is binary": binary_body,
    "server: prompts x n over --max_pending": server_case(
        {"prompt": ["a"] * 8, "n": 9, "max_tokens": 1}, 400, "prompt"),
    "server: Authorization bearer in lower case": server_case(
        {"prompt": "a", "max_tokens": 1}, 200, headers={"authorization": "bearer k"}),
    "server: a client hanging up mid-body": server_hangup,
    # --- serve.py flags
    "serve.py --block_size 0": serve_flag("--block_size", "0"),
    "serve.py --max_batch 0": serve_flag("--max_batch", "0"),
    "serve.py --num_blocks -1": serve_flag("--num_blocks", "-1"),
    "serve.py --timeout nan": serve_flag("--timeout", "nan"),
    "serve.py --max_pending 0": serve_flag("--max_pending", "0"),
    # --- generate.py batch files and flags
    "batch file: stop 5": batch_case('{"prompt": "a", "stop": 5}\n'),
    "batch file: temperature true": batch_case('{"prompt": "a", "temperature": true}\n'),
    "batch file: max_new_tokens -1": batch_case('{"prompt": "a", "max_new_tokens": -1}\n'),
    "batch file: seed 2**70": batch_case(json.dumps({"prompt": "a", "seed": 2**70}) + "\n"),
    "batch file: binary": batch_case(b"\x89PNG\r\n\x1a\n\x00\x00binary"),
    "batch file: --output a directory": batch_case(GOOD_BATCH, "--output", "{d}"),
    "batch file: --max_batch 0": batch_case(GOOD_BATCH, "--max_batch", "0"),
    "generate.py --seed 2**70": batch_case(GOOD_BATCH, "--seed", str(2**70)),
    # --- the conformance kit
    "kit: a module returning NaN": kit_case("NaNs", "returns non-finite values"),
    "kit: a module changing its input": kit_case("Mutates", "changed its input tensor"),
    "kit: a slow module, 5 s budget": kit_case("Slow", "time budget of 5 s ran out",
                                               "--time_budget", "5"),
}


CASES = {
    # --- the corpus
    "the default tiny run": train_case({}, expect_error=False),
    "a missing file": train_case({}, source="{d}/missing.txt"),
    "a typo'd local name (taken for a hub dataset)":
        train_case({"small.txt": "x " * 400}, source="smal"),
    "a hub dataset, offline": train_case({}, source="someone/corpus"),
    "a folder with no corpus files": train_case({"a.csv": "1,2"}, source="{d}"),
    "a glob matching nothing": train_case({}, source="{d}/*.txt"),
    "an unsupported extension": train_case({"a.csv": "1,2"}, source="{d}/a.csv"),
    "an empty file": train_case({"e.txt": ""}, source="{d}/e.txt"),
    "a corpus shorter than the context": train_case({"s.txt": "To be."}, source="{d}/s.txt"),
    "Latin-1 bytes": train_case({"l.txt": "caf\u00e9 ".encode("latin-1") * 300},
                                source="{d}/l.txt"),
    "Latin-1 bytes, with encoding_errors replace": train_case(
        {"l.txt": "caf\u00e9 ".encode("latin-1") * 300}, "--data.corpus.encoding_errors", "replace",
        source="{d}/l.txt", expect_error=False),
    "UTF-16 text": train_case({"w.txt": ("\ufeff" + "wide text " * 300).encode("utf-16-le")},
                              source="{d}/w.txt"),
    "UTF-32 text": train_case({"w.txt": ("wider text " * 300).encode("utf-32")},
                              source="{d}/w.txt"),
    "a .gz that is not gzip": train_case({"p.txt.gz": "plain " * 300}, source="{d}/p.txt.gz"),
    "a truncated .gz": train_case({"t.txt.gz": gzip.compress(RANDOM_WORDS)[:4000]},
                                  source="{d}/t.txt.gz"),
    "a jsonl cut off mid-line": train_case({"d.jsonl": jsonl(GOOD) + '{"text": "cut off'},
                                           source="{d}/d.jsonl"),
    "jsonl records without the text field": missing_text(skip=False),
    "the same, skipping them on purpose": missing_text(skip=True),
    "a text_field that no record has": train_case(
        {"d.jsonl": jsonl(GOOD)}, "--data.corpus.text_field", "body", source="{d}/d.jsonl"),
    "a text_field holding numbers": train_case(
        {"d.jsonl": jsonl([{"text": 1} for _ in range(50)])}, source="{d}/d.jsonl"),
    "json files whose fields differ": train_case(
        {"a.jsonl": jsonl(GOOD), "b.jsonl": jsonl([{**r, "id": i} for i, r in enumerate(GOOD)])},
        source="{d}/*.jsonl", expect_error=False),
    "val_fraction 1.5": train_case({}, "--data.corpus.val_fraction", "1.5"),
    "batch_size 0": train_case({}, "--data.loader.batch_size", "0"),
    "num_workers -1": train_case({}, "--data.loader.num_workers", "-1"),
    # --- the command line
    "max_steps -5": train_case({}, "--trainer.max_steps", "-5"),
    "accelerator gpu without a GPU": train_case({}, "--trainer.accelerator", "gpu"),
    "checkpoint_every -1": train_case({}, "--checkpoint_every", "-1"),
    "checkpoint_every 0": train_case({}, "--checkpoint_every", "0"),
    "sample_every -1": train_case({}, "--sample_every", "-1"),
    "an unknown option": train_case({}, "--model.n_layer", "2"),
    "n_heads that do not divide emb_dim": train_case({}, "--model.n_heads", "3"),
    "a negative learning rate": train_case({}, "--model.learning_rate", "-1"),
    "a tiktoken encoding, offline": train_case({}, "--model.tokenizer", "cl100k_base"),
    "an unknown tokenizer": train_case({}, "--model.tokenizer", "nope"),
    "fast_dev_run": train_case({}, "--trainer.fast_dev_run", "true", expect_error=False),
    "validation inside a gradient accumulation": train_case(
        {}, "--trainer.accumulate_grad_batches", "4", "--trainer.val_check_interval", "6"),
    "a missing --config": train_case({}, "--config", "missing.yaml"),
    "a --config that is not YAML": train_case({"c.yaml": "model: [unclosed"}, "--config",
                                              "c.yaml"),
    "init_from a missing folder": train_case({}, "--model.init_from", "nowhere"),
    # --- checkpoints and resume
    "a missing --ckpt_path": train_case({}, "--ckpt_path", "nope.ckpt"),
    "a text file as --ckpt_path": train_case({"n.ckpt": "my notes"}, "--ckpt_path", "n.ckpt"),
    "a truncated --ckpt_path": train_case({"t.ckpt": b"PK\x03\x04" + b"\0" * 500},
                                          "--ckpt_path", "t.ckpt"),
    "a second run under the same --run_name": reuse_run_name,
    "a new learning rate on resume": resume_changed_lr,
    "resume exactly, 2 data loader workers": resume_exactly(["--data.loader.num_workers", "2"]),
    "resume exactly, gradient accumulation 2": resume_exactly(
        ["--trainer.accumulate_grad_batches", "2"]),
    "resume exactly, 2 DDP ranks with dropout": resume_exactly([], ranks=2, total=6),
    "SIGTERM (kill, docker stop)": signal_case(signal.SIGTERM),
    "Ctrl-C (SIGINT)": signal_case(signal.SIGINT),
    "kill -9 mid-save, $TMPDIR on tmpfs": kill_mid_save,
    "a file-size limit during a save": file_size_limit,
    # --- generation
    "generate.py: a missing checkpoint": generate_case(lambda lab, w: ["--checkpoint",
                                                                      w / "nope.ckpt"]),
    "generate.py: a text file as checkpoint": generate_case(corrupt_checkpoint(b"my notes")),
    "generate.py: a truncated checkpoint": generate_case(corrupt_checkpoint(b"")),
    "generate.py: a malicious pickle": malicious_case,
    "generate.py: truncated safetensors": generate_case(truncated_hf),
    "generate.py: a padded vocabulary, hot sampling": generate_case(padded_vocab),
    "generate.py: --device cuda without a GPU": generate_case(
        lambda lab, w: ["--checkpoint", trained(lab, w), "--device", "cuda"]),
    "generate.py: a missing --prompt_file": generate_case(
        lambda lab, w: ["--checkpoint", trained(lab, w), "--prompt_file", "nope.txt"]),
    **ISSUE_29,
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[1],
                        help="the checkout whose train.py and generate.py are run")
    parser.add_argument("-k", default="", help="only cases whose name contains this")
    args = parser.parse_args()
    counts = Counter()
    with tempfile.TemporaryDirectory() as root:
        lab = Lab(args.tree.resolve(), Path(root))
        print(f"tree: {lab.tree}\n")
        print(f"{'case':<50} {'outcome':<12} detail")
        for name, case in CASES.items():
            if args.k not in name:
                continue
            start = time.perf_counter()
            try:
                result, detail = case(lab)
            except subprocess.TimeoutExpired as err:
                result, detail = "hang", f"no answer in {err.timeout:g} s"
            except Exception as err:  # the harness itself: say so, keep going
                result, detail = "harness", f"{type(err).__name__}: {err}"
            counts[result] += 1
            print(f"{name:<50} {result:<12} {detail} ({time.perf_counter() - start:.0f} s)",
                  flush=True)
        Served.stop()
    total = sum(counts.values())
    print(f"\n{total} cases: " + ", ".join(f"{n} {k}" for k, n in counts.most_common()))


if __name__ == "__main__":
    main()
