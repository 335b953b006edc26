"""The README runs as written: its python blocks and its shell commands that need no GPU,
no network and no minutes of training, against a tiny run saved where the README's run is
(runs/shakespeare-cpu). Every other command must be named in SKIPPED with the reason, so a
new command in the README is either run here or says why not."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import tiny_args

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
SKIPPED = {
    "python3 -m venv": "Set-up: installs (CI runs exactly this line)",
    "pip install": "installs from the network",
    "hf download": "downloads GPT-2",
    "checkpoints/gpt2": "needs the GPT-2 download",
    "configs/shakespeare-gpu.yaml": "needs a GPU",
    "gpt2-124m-fineweb": "needs 8 GPUs and the network",
    "gpt2-finetune-shakespeare": "needs the GPT-2 download",
    "HuggingFaceFW": "needs the network",
    "Rowan/hellaswag": "needs the network",
    "--data.corpus.source": "needs the reader's own corpus",
    "--ckpt_path last": "resumes the default run (minutes of training)",
    "--trainer.fast_dev_run": "fits and tokenizes the default run's corpus (slow here)",
    "--attention_every": "trains the default run (minutes)",
    "serve.py": "started by this test on a free port",
}
PYTHON_SKIPPED = {"checkpoints/gpt2": "needs the GPT-2 download"}


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, re.S)


def commands() -> list[str]:
    """The README's shell commands, continuation lines joined, comments and blanks dropped."""
    out = []
    for block in blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                out.append(line)
    return out


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """A folder laid out as the README's clone after `python train.py`: the entry scripts,
    the README, and a tiny run at runs/shakespeare-cpu."""
    from helpers import write_corpus

    from gptmini.train.command import main

    root = tmp_path_factory.mktemp("clone")
    for name in ("train.py", "generate.py", "evaluate.py", "visualize.py", "serve.py",
                 "README.md"):
        (root / name).symlink_to(REPO / name)
    corpus = write_corpus(root / "corpus.txt", repeats=12)
    args = tiny_args(root, corpus, "--run_name", "shakespeare-cpu", "--trainer.max_steps", "10",
                     "--trainer.val_check_interval", "5")
    assert main(args) == 0
    return root


def run(command: str, cwd: Path, port: int) -> subprocess.CompletedProcess:
    command = command.replace(".venv/bin/python", sys.executable).replace("8000", str(port))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, shell=True, cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.slow
def test_every_readme_command_runs_or_says_why_not(clone):
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "serve.py", "--checkpoint", "runs/shakespeare-cpu/checkpoints/last.ckpt",
         "--port", str(port)], cwd=clone, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    try:
        ran = []
        for command in commands():
            if any(key in command for key in SKIPPED):
                continue
            if command.startswith("curl"):
                wait_for(port, server)
            proc = run(command, clone, port)
            assert proc.returncode == 0, f"{command}\n{proc.stderr[-2000:]}"
            if command.startswith("curl"):
                assert json.loads(proc.stdout)["choices"][0]["finish_reason"] in ("stop",
                                                                                  "length")
            ran.append((command, proc.stdout))
        assert len(ran) >= 10, ran
        assert (clone / "results.jsonl").read_text().count("\n") == 4  # the four prompts
        assert all("bits per byte" in out for command, out in ran if "evaluate.py" in command)

        # The python blocks, in order, in one namespace, as a reader pastes them.
        namespace: dict = {"__name__": "__readme__"}
        cwd = Path.cwd()
        os.chdir(clone)
        try:
            for block in blocks("python"):
                if any(key in block for key in PYTHON_SKIPPED):
                    continue
                exec(compile(block.replace("8000", str(port)), "README.md", "exec"), namespace)
        finally:
            os.chdir(cwd)
    finally:
        server.terminate()
        server.wait(timeout=60)


def wait_for(port: int, server: subprocess.Popen, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert server.poll() is None, server.stdout.read()
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise AssertionError(f"serve.py did not listen on {port} in {seconds} s")


def test_the_book_snippet_prints_the_books_numbers(capsys):
    exec(compile(blocks("python")[0], "README.md", "exec"), {})
    assert "[[[0.3190, 0.4858]," in capsys.readouterr().out


def test_every_skipped_command_is_still_in_the_readme():
    """A skip that matches nothing would hide nothing and mislead: keep the table honest."""
    text = "\n".join(commands()) + "\n".join(blocks("python"))
    assert [key for key in {**SKIPPED, **PYTHON_SKIPPED} if key not in text] == []
    assert shutil.which("sh")
