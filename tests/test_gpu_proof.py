"""bench/gpu_proof.py, the one command that proves the GPU path, kept from rotting until a GPU
is lent: every part runs end to end on a CPU with tiny shapes, without datasets or wandb
(a GPU machine lacks both), and writes the figures file whose fields are checked here."""

import json
import math
import os
import subprocess
import sys

import pytest
from helpers import HANG_SECONDS, REPO

ITEMS = {"parity": 1, "training": 1, "decoding": 1, "fsdp": 1, "gpu_tests": 1,
         "micro_batches": 2, "decoding_compiled": 2, "default_run": 3, "engine": 3}


@pytest.fixture
def gpu_proof(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import gpu_proof

    return gpu_proof


@pytest.mark.slow
def test_every_part_runs_on_a_cpu_without_datasets_or_wandb(tmp_path):
    blocked = tmp_path / "blocked"  # first on the path of the command and of its pytest
    blocked.mkdir()
    for name in ("datasets", "wandb"):
        (blocked / f"{name}.py").write_text(f"raise ImportError('the GPU proof imported {name}')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocked), str(REPO)]),
           "OMP_NUM_THREADS": "1", "GPTMINI_CACHE": str(tmp_path / "cache")}  # as on a new machine
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "bench/gpu_proof.py", "--device", "cpu", "--tiny", "--part", "1", "2",
         "3", "--out", str(out), "--runs", str(tmp_path / "runs")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=HANG_SECONDS)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads((out / "gpu_proof.json").read_text())
    items = figures["items"]
    assert figures["parts"] == [1, 2, 3] and figures["tiny"] is True
    assert {name: item["part"] for name, item in items.items()} == ITEMS

    tests = items["gpu_tests"]  # collected and run, each skipped: no CUDA here
    assert tests["status"] == "skipped" and tests["tests"] >= 5
    assert tests["skipped"] == tests["tests"] and tests["failed"] == []
    assert {(c["dtype"], c["passed"]) for c in items["parity"]["cases"]} == {
        ("float32", True), ("bfloat16", True)}
    sharded = items["fsdp"]  # FSDP2 runs on a CPU too (gloo)
    assert sharded["status"] == "ok" and sharded["steps"] == 4
    assert sharded["checkpoint"] == "directory" and sharded["consolidated_equal"]

    train = items["training"]
    for path in ("plain", "lightning"):  # MFU = FLOPs per token x tokens/s / peak
        rate = train[f"{path}_tokens_per_s"]
        assert train[f"{path}_mfu"] == pytest.approx(
            train["flops_per_token"] * rate / train["peak_bf16_flops"])
    batches = items["micro_batches"]
    assert batches["largest_micro_batch"] == 8
    assert list(batches["tokens_per_s_by_micro_batch"]) == ["4", "8"]
    assert batches["mfu_by_micro_batch"]["8"] == pytest.approx(
        batches["flops_per_token"] * batches["tokens_per_s_by_micro_batch"]["8"]
        / batches["peak_bf16_flops"])

    run = items["default_run"]
    assert run["status"] == "ok" and run["steps"] == run["steps_asked"] == 4
    assert 0 < run["val_bpb_whole_split"] < math.log2(4096)  # below uniform over bpe:4096
    engine = items["engine"]
    assert engine["requests"] == 256 and engine["prefilled_tokens"] < engine["prompt_tokens"]
    assert engine["tokens_per_s_batch_64"] > 0 and engine["tokens_per_s_batch_1"] > 0
    assert set(items["decoding"]["eager_tokens_per_s"]) == {"1", "64"}

    table = (out / "gpu_proof.md").read_text()
    assert all(f"| {part} | {name} |" in table for name, part in ITEMS.items())


def test_a_spent_budget_writes_every_item_out_of_time(gpu_proof, tmp_path):
    assert gpu_proof.main(["--device", "cpu", "--tiny", "--budget", "0", "--part", "1", "2",
                           "3", "--out", str(tmp_path)]) == 0
    figures = json.loads((tmp_path / "gpu_proof.json").read_text())
    assert {k: v["status"] for k, v in figures["items"].items()} == dict.fromkeys(
        ITEMS, "out of time")


def test_the_headline_is_part_1_alone_by_default(gpu_proof, tmp_path):
    assert gpu_proof.main(["--device", "cpu", "--tiny", "--budget", "0", "--out",
                           str(tmp_path)]) == 0
    figures = json.loads((tmp_path / "gpu_proof.json").read_text())
    assert figures["parts"] == [1]
    assert list(figures["items"]) == [k for k, p in ITEMS.items() if p == 1]


def test_the_parts_of_several_calls_merge_into_one_file(gpu_proof, tmp_path):
    for part in (1, 3):
        gpu_proof.main(["--device", "cpu", "--tiny", "--budget", "0", "--part", str(part),
                        "--out", str(tmp_path / f"part{part}")])
    gpu_proof.main(["--merge", str(tmp_path / "part1" / "gpu_proof.json"),
                    str(tmp_path / "part3" / "gpu_proof.json"), "--out", str(tmp_path)])
    figures = json.loads((tmp_path / "gpu_proof.json").read_text())
    assert figures["parts"] == [1, 3]
    assert [k for k in figures["items"]] == [k for k, p in ITEMS.items() if p != 2]
    assert "| 3 | engine | out of time |" in (tmp_path / "gpu_proof.md").read_text()


def test_no_gpu_is_said_in_one_line(gpu_proof, capsys):
    if gpu_proof.torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert gpu_proof.main(["--device", "cuda"]) == 2
    assert "no CUDA GPU here" in capsys.readouterr().err
