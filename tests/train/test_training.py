"""End-to-end training on CPU: a short run, exact resume, NaN stop, DDP, configs, bad input."""

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import HANG_SECONDS, column, read_metrics, tiny_args, write_corpus
from lightning.pytorch import Callback

import gptmini
from gptmini.chat import BOOK
from gptmini.data import Corpus, GPTDataModule, Loader, Windows
from gptmini.data.chat import Chat
from gptmini.data.preference import Preference
from gptmini.data.rl import RL
from gptmini.model import GPTConfig
from gptmini.train.command import DEFAULT_CONFIG, build_cli, fit, main
from gptmini.train.module import GPTLitModule

REPO = Path(__file__).resolve().parents[2]

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


@pytest.mark.slow
def test_short_run_lowers_the_loss_and_writes_checkpoints(tmp_path, corpus):
    assert main(tiny_args(tmp_path, corpus, "--sample_every", "15")) == 0
    run = tmp_path / "runs" / "tiny"
    rows = read_metrics(run)
    train, val = column(rows, "train/loss"), column(rows, "val/loss")
    assert len(val) == 3
    assert val[-1] < val[0] - 0.5, val
    assert train[-1] < train[0] - 1.0, train
    for key in ("train/lr", "train/grad_norm", "train/tokens_per_sec", "train/mfu", "val/ppl"):
        assert column(rows, key), key
    assert (run / "checkpoints" / "last.ckpt").is_file()
    assert (run / "checkpoints" / "best.ckpt").is_file()
    # A checkpoint alone rebuilds the model, and loads without unpickling arbitrary objects.
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 30
    hparams = {k: v for k, v in ckpt["hyper_parameters"].items() if not k.startswith("_")}
    module = GPTLitModule(**hparams)
    module.load_state_dict(ckpt["state_dict"])


@pytest.mark.slow
def test_compiled_model_trains_samples_and_draws_attention_on_cpu(tmp_path, corpus, capsys):
    pytest.importorskip("matplotlib")
    args = tiny_args(tmp_path, corpus, "--model.compile", "true", "--trainer.max_steps", "6",
                     "--trainer.val_check_interval", "3", "--sample_every", "3",
                     "--attention_every", "3")
    assert main(args) == 0
    run = tmp_path / "runs" / "tiny"
    assert len(column(read_metrics(run), "train/loss")) == 6
    assert "[step 6]" in capsys.readouterr().out  # the sample of text
    assert sorted(p.name for p in run.glob("logs/version_0/attention/*.png")) == [
        "step_3.png", "step_6.png"]
    assert (run / "checkpoints" / "last.ckpt").is_file()


class PoisonAt(Callback):
    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, *args):
        if trainer.global_step == self.step:
            with torch.no_grad():
                pl_module.model.final_norm.weight.fill_(float("nan"))


@pytest.mark.slow
def test_nan_loss_stops_the_run_naming_the_step_and_keeps_the_last_checkpoint(tmp_path, corpus):
    cli = build_cli(tiny_args(tmp_path, corpus, "--checkpoint_every", "1"))
    cli.trainer.callbacks.append(PoisonAt(7))
    with pytest.raises(FloatingPointError, match="not finite at step 7"):
        fit(cli)
    last = tmp_path / "runs" / "tiny" / "checkpoints" / "last.ckpt"
    ckpt = torch.load(last, weights_only=True)
    assert ckpt["global_step"] == 7
    assert all(torch.isfinite(v).all() for v in ckpt["state_dict"].values())


@pytest.mark.slow
def test_a_run_and_its_resume_print_no_adverts_or_deprecation_warnings(tmp_path, corpus):
    """Before: Lightning's litlogger advert at every start, and at every resume a
    deprecation warning from its own code and "checkpoint directory is not empty"."""
    args = tiny_args(tmp_path, corpus, "--trainer.max_steps", "4", "--checkpoint_every", "2")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "default"}
    printed = ""
    for extra in ([], ["--trainer.max_steps", "6", "--ckpt_path", "last"]):
        proc = subprocess.run([sys.executable, str(REPO / "train.py"), *args, *extra],
                              cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=HANG_SECONDS)
        assert proc.returncode == 0, proc.stderr[-2000:]
        printed += proc.stdout + proc.stderr
    assert "Restored all states" in printed  # the resume did happen
    for noise in ("Tip:", "litlogger", "is deprecated", "exists and is not empty"):
        assert noise not in printed


def test_the_save_on_a_signal_says_nothing_of_weights_only(tmp_path, corpus):
    """Before: "`weights_only` was not set, defaulting to `False`" at the save on Ctrl-C."""
    import logging
    import signal

    from gptmini.train.callbacks import RunInterrupted

    class Sigterm(Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 2:
                os.kill(os.getpid(), signal.SIGTERM)

    records = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    logger = logging.getLogger("lightning.pytorch.trainer.connectors.checkpoint_connector")
    logger.addHandler(handler)
    level, logger.level = logger.level, logging.DEBUG
    try:
        cli = build_cli(tiny_args(tmp_path, corpus, "--trainer.max_steps", "10"))
        cli.trainer.callbacks.insert(0, Sigterm())
        with pytest.raises(RunInterrupted):
            fit(cli, own_signals=True)  # as train.py: the SIGTERM is not handed on
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert (tmp_path / "runs" / "tiny" / "checkpoints" / "last.ckpt").is_file()
    assert not [r for r in records if "weights_only" in r.getMessage()]


@pytest.mark.slow
def test_wandb_without_a_key_runs_offline_and_never_prompts(tmp_path, corpus):
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB")}
    env.update(HOME=str(tmp_path), OMP_NUM_THREADS="1")
    args = tiny_args(tmp_path, corpus, "--trainer.max_steps", "5", "--wandb", "true")
    proc = subprocess.run(
        [sys.executable, str(REPO / "train.py"), *args],
        cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
        timeout=HANG_SECONDS,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "logging offline" in proc.stdout and "wandb sync" in proc.stdout
    assert list((tmp_path / "runs" / "tiny" / "wandb").glob("offline-run-*"))
    assert read_metrics(tmp_path / "runs" / "tiny")  # CSV keeps working beside wandb

DDP_SCRIPT = """
import json, sys
from lightning.pytorch import Callback
from gptmini.train.command import build_cli, fit


class Record(Callback):
    def __init__(self):
        self.windows, self.documents = [], 0
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.windows += [row[:8].tolist() for row in batch[0]]
        self.documents = max(self.documents, int(batch[2].max()) + 1)  # per window
    def on_train_end(self, trainer, pl_module):
        with open(f"{out}/rank{trainer.global_rank}.json", "w") as f:
            json.dump({"windows": self.windows, "step": trainer.global_step,
                       "documents": self.documents}, f)

out = sys.argv[1]
cli = build_cli(sys.argv[2:])
cli.trainer.callbacks.append(Record())
fit(cli)
"""


@pytest.mark.slow
def test_two_process_ddp_trains_each_rank_on_different_windows_with_document_masks(tmp_path):
    corpus = tmp_path / "numbers"  # 50 documents; no two windows alike
    corpus.mkdir()
    for d in range(50):
        (corpus / f"{d:02d}.txt").write_text(" ".join(str(i) for i in range(d * 40, d * 40 + 40)))
    script = tmp_path / "ddp_run.py"
    script.write_text(textwrap.dedent(DDP_SCRIPT))
    args = tiny_args(tmp_path, corpus, "--trainer.max_steps", "6", "--trainer.devices", "2",
                     "--trainer.strategy", "ddp", "--data.windows.stride", "4",
                     "--data.windows.document_mask", "true", "--data.corpus.val_fraction", "0.1")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": "29533"}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path), *args], cwd=tmp_path,
                          env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=HANG_SECONDS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all(r["step"] == 6 for r in ranks)
    seen = [{tuple(w) for w in r["windows"]} for r in ranks]
    assert len(ranks[0]["windows"]) == len(ranks[1]["windows"]) == 6 * 4
    assert not seen[0] & seen[1], "both ranks trained on the same windows"
    assert all(r["documents"] >= 2 for r in ranks)  # windows that hold several documents


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_every_config_loads_and_builds_its_model_and_data(config, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_cli(["--config", str(config), "--print_config"])
    assert exit_info.value.code in (0, None)
    import yaml

    printed = yaml.safe_load(capsys.readouterr().out)
    data = printed["data"]
    # linked: they follow model.context_length and model.tokenizer
    assert "max_length" not in data["windows"] and "tokenizer" not in data["corpus"]
    # bpe:N is fitted by train.py before the module exists; the shapes are checked here
    # with a vocabulary that needs no corpus (the fitting is tested end to end elsewhere).
    model = {**printed["model"], "peak_flops": 1.0}
    if model["tokenizer"].startswith("bpe:"):
        model["tokenizer"] = "byte"
    # an RL run's task needs its checker and a template (train.py's plan resolves them from
    # the source; the book's needs no tokens this vocabulary lacks)
    rl = RL(**data["rl"])
    given = {"verifier": rl.load(), "chat_template": BOOK} if rl.task else {}
    with torch.device("meta"):
        GPTLitModule(**model, **given)
    chat, pairs = ({**data[k], "split": tuple(data[k]["split"])} for k in ("chat", "preference"))
    GPTDataModule(Corpus(**data["corpus"], tokenizer=model["tokenizer"]),
                  Windows(**data["windows"], max_length=model["context_length"]),
                  Loader(**data["loader"]), Chat(**chat), preference=Preference(**pairs), rl=rl)


def print_config(capsys, *args: str) -> dict:
    import yaml

    with pytest.raises(SystemExit):
        build_cli([*args, "--print_config"])
    return yaml.safe_load(capsys.readouterr().out)


def test_no_arguments_means_the_default_run_config_shipped_in_the_package(capsys):
    import yaml

    assert DEFAULT_CONFIG.parent.parent == Path(gptmini.__file__).parent  # package data
    written = yaml.safe_load(DEFAULT_CONFIG.read_text())
    default = print_config(capsys)

    def check(written: dict, printed: dict, where: str) -> None:
        for key, value in written.items():
            if isinstance(value, dict):  # a section (model:) or a part of one (data.corpus:)
                check(value, printed[key], f"{where}{key}.")
            else:
                assert printed[key] == value, f"{where}{key}"

    check(written, default, "")
    assert default["data"]["corpus"]["source"] is None  # the embedded corpus
    # What the default run leaves unset comes from GPTConfig, the one place model fields live.
    book = GPTConfig()
    for field in ("qkv_bias", "window_size", "padded_vocab_size"):
        assert field not in written["model"] and default["model"][field] == getattr(book, field)
    # Flags apply on top of the default run (a --config file is a whole run of its own:
    # tests/train/test_configs.py).
    on_top = print_config(capsys, "--model.n_layers", "2")
    assert on_top["model"] == {**default["model"], "n_layers": 2}


def test_the_module_declares_no_model_field_of_its_own():
    import inspect

    declared = set(inspect.signature(GPTLitModule).parameters)
    assert not declared & set(GPTConfig.__dataclass_fields__)
    module = GPTLitModule(n_layers=1, emb_dim=8, n_heads=2, context_length=8, peak_flops=1.0)
    assert module.cfg == GPTConfig(vocab_size=50257, n_layers=1, emb_dim=8, n_heads=2,
                                   context_length=8)  # the rest: GPTConfig's defaults


@pytest.mark.parametrize(
    ("old", "new"),
    [("--model.n_layer", "--model.n_layers"),
     # the data settings before they were grouped (corpus, windows, loader)
     ("--data.source", "--data.corpus.source"), ("--data.stride", "--data.windows.stride"),
     ("--data.batch_size", "--data.loader.batch_size"),
     # Lightning's own optimizer and schedule replaced ours silently: there are none now
     ("--optimizer", "--model.optimizer")],
)
def test_unknown_option_names_the_key_and_suggests_the_close_one(old, new):
    with pytest.raises(SystemExit, match=rf"unknown option {old}; did you mean {new}\?"):
        build_cli([old, "2"])


def test_a_retired_option_says_what_replaced_it():
    with pytest.raises(SystemExit, match=r"--model.mla_kv_lora_rank is gone: .*"
                                         r"--model.layer_kinds '\[mla, .*--model.mixer_options"):
        build_cli(["--model.mla_kv_lora_rank", "32"])


def test_no_option_of_lightnings_replaces_the_optimizer_or_its_schedule():
    """Before: `--optimizer SGD` replaced Muon/AdamW and the warmup-cosine schedule, and
    `--optimizer.lr 0.1` was an unknown option."""
    for option in ("--optimizer.lr", "--lr_scheduler", "--lr_scheduler.class_path"):
        with pytest.raises(SystemExit, match=rf"unknown option {re.escape(option)}"):
            build_cli([option, "0.1"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model.learning_rate", "-1"], "--model.learning_rate -1.0 is invalid"),
        (["--data.loader.batch_size", "0"], "batch_size"),
    ],
)
def test_invalid_values_give_one_clear_line(tmp_path, corpus, capsys, args, message):
    assert main(tiny_args(tmp_path, corpus, *args)) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_corpus_too_short_for_the_context(tmp_path, capsys):
    short = tmp_path / "short.txt"
    short.write_text("To be or not to be.")
    assert main(tiny_args(tmp_path, short)) == 1
    err = capsys.readouterr().err
    assert "short.txt" in err and "tokens" in err


@pytest.mark.slow
def test_a_fine_tuning_run_resumes_after_its_source_directory_is_gone(tmp_path, corpus):
    """The defect: resume re-read --model.init_from, so a deleted GPT-2 directory broke it."""
    import shutil

    from gptmini.convert import export_hf
    from gptmini.model import GPTModel

    torch.manual_seed(3)
    source = export_hf(GPTModel(GPTConfig(vocab_size=50257, context_length=16, emb_dim=32,
                                          n_heads=2, n_layers=2, qkv_bias=True,
                                          tie_weights=True)), tmp_path / "gpt2")
    args = ["--config", str(REPO / "configs" / "book-gpt2.yaml"),  # GPT-2's blocks
            *tiny_args(tmp_path, corpus, "--model.init_from", str(source), "--model.qkv_bias",
                       "true", "--trainer.max_steps", "4", "--checkpoint_every", "2",
                       "--model.warmup_steps", "1")]
    assert main(args) == 0
    shutil.rmtree(source)
    assert main([*args, "--trainer.max_steps", "6", "--ckpt_path", "last"]) == 0
    ckpt = torch.load(tmp_path / "runs" / "tiny" / "checkpoints" / "last.ckpt",
                      weights_only=True)
    assert ckpt["global_step"] == 6


def tiny_gpt2_directory(path: Path, **shape) -> Path:
    from gptmini.convert import export_hf
    from gptmini.model import GPTModel

    return export_hf(GPTModel(GPTConfig(vocab_size=50257, qkv_bias=True, tie_weights=True,
                                        **shape)), path)


@pytest.mark.slow
@pytest.mark.parametrize("config", [DEFAULT_CONFIG, *CONFIGS],
                         ids=["default", *(c.stem for c in CONFIGS)])
def test_fast_dev_run_works_on_every_shipped_config(tmp_path, corpus, config):
    """The defect: warmup_steps=60 is longer than the run (1 step) ended every fast_dev_run."""
    args = ["--config", str(config), "--trainer.fast_dev_run", "true",
            "--trainer.default_root_dir", str(tmp_path / "runs"),
            "--trainer.enable_progress_bar", "false",
            "--data.corpus.cache_dir", str(tmp_path / "c")]
    if config != DEFAULT_CONFIG:  # a GPU run, brought to this CPU with a tiny model
        # instruction records are longer than 16 tokens (the book's are up to ~200), and an
        # RL task's prompt and answer together too
        text = config.read_text()
        context = 256 if "records:" in text or "\n  rl:" in text else 16
        shape = {"n_layers": 1, "emb_dim": 32, "n_heads": 2, "context_length": context}
        args += ["--trainer.accelerator", "cpu", "--trainer.devices", "1",
                 "--trainer.num_nodes", "1", "--trainer.strategy", "auto",
                 "--data.corpus.source", str(corpus), "--data.corpus.streaming", "false",
                 "--data.corpus.hub_config", "null", "--data.loader.num_workers", "0",
                 "--data.corpus.num_proc", "1", "--data.corpus.val_fraction", "0.1",
                 "--data.loader.batch_size", "2", "--model.compile", "false"]
        args += [f"--model.{k}={v}" for k, v in shape.items()]
        if "init_from" in config.read_text():
            args += ["--model.init_from", str(tiny_gpt2_directory(tmp_path / "gpt2", **shape))]
    assert main(args) == 0


MALLINFO = """
import ctypes, ctypes.util, runpy, sys
import torch

class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks",
                "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype = Mallinfo2
sys.argv = ["train.py", "--print_config"]
try:
    if sys.argv_mode == "entry":
        runpy.run_path("train.py", run_name="__main__")
    else:
        from gptmini.train.command import build_cli
        build_cli(sys.argv[1:])
except SystemExit:
    pass
before = libc.mallinfo2().hblkhd
x = torch.ones(64 * 2**20, dtype=torch.uint8)  # 64 MB: glibc would mmap it
print(libc.mallinfo2().hblkhd - before)
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_only_train_py_keeps_freed_memory_and_then_large_tensors_stay_on_the_heap():
    """keep_freed_memory is process-wide, so the library (build_cli, tests) never sets it."""
    mmapped = {}
    for mode in ("entry", "library"):
        script = MALLINFO.replace("sys.argv_mode", repr(mode))
        proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                              text=True, timeout=HANG_SECONDS,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-2000:]
        mmapped[mode] = int(proc.stdout.split()[-1])
    assert mmapped["entry"] <= 0  # served from the heap, kept for the next step
    assert mmapped["library"] >= 64 * 2**20  # glibc's default: a fresh mapping


HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__format__",
              "cpu", "numpy")
"""Reading a tensor's value on the host: on a GPU, each of these waits for the device."""


@pytest.mark.slow
def test_no_tensor_is_read_on_the_host_between_logging_steps(tmp_path, corpus, monkeypatch):
    """A CPU stand-in for torch.cuda.set_sync_debug_mode("error") (tests/test_gpu.py): every
    host read of a tensor during training batches, with the batch it happened in. AdamW's:
    Muon cannot skip a non-finite step on the device and reads that flag every step."""
    import traceback

    reads, batch = [], {"index": None, "stepped_to": {}}

    class Window(Callback):
        def on_train_batch_start(self, trainer, pl_module, b, batch_idx):
            batch["index"] = batch_idx

        def on_train_batch_end(self, trainer, pl_module, outputs, b, batch_idx):
            batch["stepped_to"][batch_idx] = trainer.global_step

        def on_train_end(self, trainer, pl_module):
            batch["index"] = None

    def recorded(name, original):
        def read(tensor, *args, **kwargs):
            if batch["index"] is not None:
                stack = traceback.extract_stack(limit=9)[-8:-1]
                where = "<".join(f"{f.name}:{f.lineno}" for f in stack)
                reads.append((batch["index"], name, where))
            return original(tensor, *args, **kwargs)
        return read

    args = tiny_args(tmp_path, corpus, "--trainer.max_steps", "12", "--checkpoint_every", "1000",
                     "--trainer.val_check_interval", "1000", "--trainer.log_every_n_steps", "4",
                     "--trainer.enable_progress_bar", "true",
                     "--trainer.accumulate_grad_batches", "2", "--model.optimizer", "adamw")
    cli = build_cli(args)
    cli.trainer.callbacks.insert(0, Window())
    for name in HOST_READS:
        monkeypatch.setattr(torch.Tensor, name, recorded(name, getattr(torch.Tensor, name)))
    fit(cli)
    monkeypatch.undo()
    assert batch["stepped_to"], "no batch ran"
    logging = {i for i, step in batch["stepped_to"].items()
               if step % 4 == 0 and step != batch["stepped_to"].get(i - 1)}
    outside = [r for r in reads if r[0] not in logging]
    assert not outside, outside[:10]
    assert any(r[0] in logging for r in reads)  # the check does run at logging steps


@pytest.mark.slow
def test_bf16_mixed_on_cpu_trains_saves_and_generates_like_fp32(tmp_path, corpus, capsys):
    """Precision pinned to bf16-mixed (CPU autocast), whatever this CPU's auto would pick."""
    from gptmini.checkpoint import load_checkpoint
    from gptmini.generate.command import generate_main
    from gptmini.generate.loop import generate

    args = tiny_args(tmp_path, corpus, "--trainer.precision", "bf16-mixed",
                     "--trainer.max_steps", "60", "--trainer.val_check_interval", "20")
    assert main(args) == 0
    rows = read_metrics(tmp_path / "runs" / "tiny")
    train, val = column(rows, "train/loss"), column(rows, "val/loss")
    assert train[-1] < train[0] - 3.0 and val[-1] < val[0] - 1.0
    last = tmp_path / "runs" / "tiny" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["precision"] == "bf16-mixed"
    capsys.readouterr()
    assert generate_main(["--checkpoint", str(last), "--prompt", "Romeo said",
                          "--max_new_tokens", "8", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("Romeo said")
    model, tok, _ = load_checkpoint(last)
    prompt = torch.tensor([tok.encode("Juliet said hello to the")])
    text = generate(model, prompt, 20)[:, -16:]  # fp32's greedy text; both models read it
    with torch.no_grad():
        fp32 = model(text).float()
        bf16 = model.to(torch.bfloat16)(text).float()
    # Not token-for-token equality: where two logits nearly tie, bf16's rounding (8-bit
    # mantissas, done in other ways by CPUs with and without bf16 units) may flip the pick.
    # bf16 must agree with fp32 within its own precision, and pick fp32's token wherever
    # fp32's top choice leads by more than that error.
    error = (bf16 - fp32).abs().amax(-1)
    assert error.max() < 0.05 * fp32.abs().amax(), error.max()
    top2 = fp32.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 2 * error
    assert clear.any() and torch.equal(bf16.argmax(-1)[clear], fp32.argmax(-1)[clear])


@pytest.mark.slow
def test_auto_precision_is_said_and_a_resume_keeps_the_checkpoints(tmp_path, corpus, capsys,
                                                                   monkeypatch):
    import gptmini.runtime as precision

    auto = [a for a in tiny_args(tmp_path, corpus, "--trainer.max_steps", "4")
            if a not in ("--trainer.precision", "32-true")]
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: True)  # the first machine
    assert main(auto) == 0
    assert "precision: bf16-mixed (auto: the CPU has AVX512-BF16 or AMX)" in capsys.readouterr().out
    monkeypatch.setattr(precision, "cpu_has_bf16", lambda: False)  # resumed on another
    cli = build_cli([*auto, "--trainer.max_steps", "6", "--ckpt_path", "last"])
    assert "bf16-mixed (auto: kept from the checkpoint" in capsys.readouterr().out
    assert str(cli.trainer.precision) == "bf16-mixed"
    fit(cli)
    assert str(build_cli([*auto, "--run_name", "other"]).trainer.precision) == "32-true"


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sdpa", "tiled"])
def test_training_with_document_masks_lowers_the_loss(tmp_path, backend):
    corpus = tmp_path / "scenes"
    corpus.mkdir()
    for d in range(30):
        (corpus / f"{d:02d}.txt").write_text(write_corpus(tmp_path / "one.txt", 1).read_text())
    args = tiny_args(tmp_path, corpus, "--data.windows.document_mask", "true",
                     "--model.attention_backend", backend, "--model.attn_drop_rate", "0",
                     "--trainer.max_steps", "40")
    assert main(args) == 0
    rows = read_metrics(tmp_path / "runs" / "tiny")
    train, val = column(rows, "train/loss"), column(rows, "val/loss")
    assert train[-1] < train[0] - 3.0 and val[-1] < val[0] - 1.0


@pytest.mark.slow
def test_a_fitted_vocabulary_travels_in_the_checkpoint(tmp_path, corpus, capsys):
    """bpe:N is fitted on the corpus and saved with the run; the checkpoint alone then
    generates, resumes and exports after the run directory's other files are gone."""
    import shutil

    from gptmini.checkpoint import load_checkpoint
    from gptmini.generate.command import generate_main
    from gptmini.tokenizer import get_tokenizer, tokenizer_fingerprint

    args = tiny_args(tmp_path, corpus, "--model.tokenizer", "bpe:300",
                     "--trainer.max_steps", "10", "--trainer.val_check_interval", "5")
    assert main(args) == 0
    run = tmp_path / "runs" / "tiny"
    fitted = get_tokenizer(str(run / "tokenizer.json"))
    ckpt = run / "checkpoints" / "last.ckpt"
    assert load_checkpoint(ckpt).model.cfg.vocab_size == fitted.n_vocab <= 300
    bpb = column(read_metrics(run), "val/bpb")
    assert len(bpb) == 2 and 0 < bpb[-1] < bpb[0]

    for path in [*run.iterdir(), corpus.parent / "cache"]:
        if path.name != "checkpoints":
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    capsys.readouterr()
    assert generate_main(["--checkpoint", str(ckpt), "--prompt", "Romeo said",
                          "--max_new_tokens", "8", "--seed", "1"]) == 0
    assert capsys.readouterr().out.startswith("Romeo said")
    loaded = load_checkpoint(ckpt)
    assert tokenizer_fingerprint(loaded.tokenizer) == tokenizer_fingerprint(fitted)

    # Resumed, the run takes its vocabulary from the checkpoint, even from another corpus.
    other = write_corpus(tmp_path / "other.txt", repeats=12)
    other.write_text(other.read_text().replace("Romeo", "Mercutio"))
    resumed = [a if a != str(corpus) else str(other) for a in args]
    assert main([*resumed, "--trainer.max_steps", "12", "--ckpt_path", "last"]) == 0
    assert tokenizer_fingerprint(get_tokenizer(str(run / "tokenizer.json"))) == \
        tokenizer_fingerprint(fitted)


def test_a_gpt2_run_resumes_with_gpt2_whatever_the_default_tokenizer(tmp_path, corpus):
    args = tiny_args(tmp_path, corpus, "--model.tokenizer", "gpt2", "--trainer.max_steps", "2",
                     "--checkpoint_every", "2")
    assert main(args) == 0
    resumed = [a if a != "gpt2" else "bpe:300" for a in args]
    assert main([*resumed, "--trainer.max_steps", "4", "--ckpt_path", "last"]) == 0
    ckpt = torch.load(tmp_path / "runs" / "tiny" / "checkpoints" / "last.ckpt",
                      weights_only=True)
    assert ckpt["global_step"] == 4 and ckpt["tokenizer"]["name"] == "gpt2"


def test_a_fitted_vocabulary_with_gpt2_weights_is_refused(tmp_path, corpus, capsys):
    shape = {"context_length": 16, "emb_dim": 32, "n_heads": 2, "n_layers": 2}
    args = tiny_args(tmp_path, corpus, "--model.tokenizer", "bpe:300", "--model.init_from",
                     str(tiny_gpt2_directory(tmp_path / "gpt2", **shape)))
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "--model.tokenizer bpe:300 contradicts" in err and "(gpt2, 50,257 ids)" in err
    assert "Traceback" not in err


@pytest.mark.slow
def test_a_run_with_the_modern_blocks_trains_and_its_checkpoint_needs_no_flags(tmp_path,
                                                                                corpus):
    """configs/modern-cpu.yaml's options on a tiny run: the checkpoint alone rebuilds the
    model (generate.py, serve.py and visualize.py take no model flags)."""
    from gptmini.checkpoint import load_checkpoint
    from gptmini.generate.loop import generate

    args = ["--config", str(REPO / "configs" / "modern-cpu.yaml"),  # the tiny run's flags on it
            *tiny_args(tmp_path, corpus, "--run_name", "modern", "--trainer.max_steps", "12",
                       "--model.attention_backend", "tiled", "--model.attn_softcap", "20")]
    assert main(args) == 0
    model, tokenizer, _ = load_checkpoint(tmp_path / "runs" / "modern" / "checkpoints" /
                                          "last.ckpt")
    cfg = model.cfg
    assert (cfg.position, cfg.norm, cfg.mlp, cfg.qk_norm, cfg.bias, cfg.attn_softcap) == (
        "rope", "rmsnorm", "swiglu", True, False, 20.0)
    assert not hasattr(model, "pos_emb")
    ids = torch.tensor([tokenizer.encode("ROMEO:")])
    assert generate(model, ids, 5, use_cache=True).shape == (1, ids.shape[1] + 5)
    from gptmini.analysis.visualize import visualize_main

    png = tmp_path / "attention.png"
    assert visualize_main(["attention", "--checkpoint", str(tmp_path / "runs" / "modern" /
                           "checkpoints" / "last.ckpt"), "--prompt", "ROMEO:", "--out",
                           str(png)]) == 0
    assert png.stat().st_size > 0


@pytest.mark.slow
def test_the_model_summary_of_a_bf16_run_says_nothing_a_user_cannot_act_on(
        tmp_path, corpus, capsys, caplog, recwarn):
    """Before: every default run printed "Precision bf16-mixed is not supported by the model
    summary" (its weights are float32: the size was right) and "Total FLOPs: 0"."""
    import logging

    caplog.set_level(logging.INFO)
    args = tiny_args(tmp_path, corpus, "--trainer.precision", "bf16-mixed",
                     "--trainer.enable_model_summary", "true", "--trainer.max_steps", "1")
    assert main(args) == 0
    printed = capsys.readouterr().out + caplog.text
    # the tiny default-recipe model: a tied 50,257 x 32 embedding, per layer queries and output
    # 2 x 32 x 32, one key/value head 2 x 32 x 16, SwiGLU 3 x 32 x 128, norms 2 x 32, QK-norm
    # 2 x 16; two layers and a final norm of 32
    params = 50257 * 32 + 2 * (2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 128 + 2 * 32 + 2 * 16) + 32
    assert "GPTModel" in printed and f"{params:,} parameters" in printed  # the summary is there
    assert "total flops" not in printed.lower()  # (the MFU line names gptmini.model.flops)
    assert not [w for w in recwarn if "model summary" in str(w.message)]
