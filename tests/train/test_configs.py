"""The runs in configs/ say what they are. Each file is a whole run: train.py reads it on the
classes' own defaults (the book's GPT-2 124M, AdamW), not on the default run, so it inherits
nothing it does not say. Its header's claims hold in the config train.py resolves from it
(`--print_config`), and no GPU run carries a choice the default run made for a CPU."""

import contextlib
import io
import re
from pathlib import Path

import pytest
import yaml
from helpers import REPO

from gptmini.model import GPT_CONFIG_124M
from gptmini.train.command import DEFAULT_CONFIG, build_cli

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
DEFAULT_RUN = object()
"""A claimed value: the default run's own (gptmini/configs/shakespeare-cpu.yaml)."""
BOOK_GPT2 = {"model.position": "learned", "model.norm": "layernorm", "model.mlp": "gelu",
             "model.bias": True, "model.qk_norm": False}
KV_PER_QUERY = {"model.n_kv_heads": None}  # GQA off: as many key/value heads as queries
SOURCE = "runs/shakespeare-cpu/checkpoints/best.ckpt"
HEADERS = {  # a config: each phrase of its header comment -> the settings that make it true
    "book-gpt2": {
        "at the default run's size": {f"model.{k}": DEFAULT_RUN for k in
                                      ("emb_dim", "n_heads", "n_layers", "context_length")},
        "learned positions, LayerNorm, 4x GELU, biases": {**BOOK_GPT2,
                                                          "model.mlp_hidden_dim": None},
        "a key/value head per query head": KV_PER_QUERY,
        "the sdpa kernel": {"model.attention_backend": "sdpa"},
        "a tied head": {"model.tie_weights": True},
        "the corpus's 4,096-token BPE": {"model.tokenizer": "bpe:4096",
                                         "data.corpus.source": None},
        "AdamW at 2e-3": {"model.optimizer": "adamw", "model.learning_rate": 2e-3},
        "8 x 128 tokens a step": {"data.loader.batch_size": 8, "model.context_length": 128,
                                  "trainer.accumulate_grad_batches": 1},
        "2,400 steps": {"trainer.max_steps": 2400},
        "eager": {"model.compile": False},
    },
    "modern-cpu": {
        "its size and vocabulary, AdamW at 2e-3, 8 x 128 tokens a step, 2,400 steps, eager": {
            "model.emb_dim": 256, "model.n_layers": 4, "model.tokenizer": "bpe:4096",
            "model.optimizer": "adamw", "model.learning_rate": 2e-3,
            "data.loader.batch_size": 8, "model.context_length": 128,
            "trainer.max_steps": 2400, "model.compile": False},
        "rotary positions, RMSNorm, SwiGLU, QK-norm, no biases and an untied head": {
            "model.position": "rope", "model.norm": "rmsnorm", "model.mlp": "swiglu",
            "model.qk_norm": True, "model.bias": False, "model.tie_weights": False},
        "a key/value head per query head (no GQA)": KV_PER_QUERY,
    },
    "shakespeare-gpu": {
        "on one GPU": {"trainer.accelerator": "gpu", "trainer.devices": 1},
        "a 6-layer, 384-wide GPT": {"model.n_layers": 6, "model.emb_dim": 384},
        "the book's GPT-2 blocks": BOOK_GPT2,
        "a key/value head per query head, the sdpa kernel": {
            **KV_PER_QUERY, "model.attention_backend": "sdpa"},
        "the corpus's 4,096-token BPE": {"model.tokenizer": "bpe:4096",
                                         "data.corpus.source": None},
        "AdamW at 1e-3": {"model.optimizer": "adamw", "model.learning_rate": 1e-3},
        "64 x 256 tokens a step": {"data.loader.batch_size": 64, "model.context_length": 256,
                                   "trainer.accumulate_grad_batches": 1},
        "bf16 and torch.compile": {"trainer.precision": "bf16-mixed", "model.compile": True},
        "5,000 steps": {"trainer.max_steps": 5000},
    },
    "gpt2-124m-fineweb": {
        "GPT-2 124M": {f"model.{k}": GPT_CONFIG_124M[k] for k in
                       ("emb_dim", "n_heads", "n_layers", "context_length")},
        "FineWeb-Edu (10B-token sample)": {"data.corpus.source": "HuggingFaceFW/fineweb-edu",
                                           "data.corpus.hub_config": "sample-10BT"},
        "8 GPUs with DDP, bf16 and torch.compile": {
            "trainer.accelerator": "gpu", "trainer.devices": 8, "trainer.strategy": "ddp",
            "trainer.precision": "bf16-mixed", "model.compile": True},
        "GPT-2's blocks with a key/value head per query head": {**BOOK_GPT2, **KV_PER_QUERY},
        "AdamW at 6e-4": {"model.optimizer": "adamw", "model.learning_rate": 6e-4},
        "16 windows x 1024 tokens x 8 GPUs x 4 accumulation steps": {
            "data.loader.batch_size": 16, "model.context_length": 1024, "trainer.devices": 8,
            "trainer.accumulate_grad_batches": 4},
        "19,073 steps": {"trainer.max_steps": 19073},
        "HellaSwag at each validation, 1,000 items": {"eval_tasks": "hellaswag",
                                                      "eval_limit": 1000},
    },
    "gpt2-finetune-shakespeare": {
        "OpenAI's GPT-2 (124M)": {"model.init_from": "checkpoints/gpt2"},
        "the embedded Shakespeare corpus": {"data.corpus.source": None},
        "on one GPU": {"trainer.accelerator": "gpu", "trainer.devices": 1},
        "every weight trains, with AdamW at 3e-5, in bf16, compiled": {
            "model.lora_rank": 0, "model.optimizer": "adamw", "model.learning_rate": 3e-5,
            "trainer.precision": "bf16-mixed", "model.compile": True},
    },
    "classify-genres": {
        "which kind of work (comedy, history, poem, tragedy)": {
            "data.labels.task": "shakespeare-genres"},
        "every weight trains, with AdamW at 3e-4, compiled": {
            "model.lora_rank": 0, "model.optimizer": "adamw", "model.learning_rate": 3e-4,
            "model.compile": True},
        "come from the checkpoint": {"model.init_from": SOURCE},
    },
    "instruct-shakespeare": {
        "Instruction-tune the default run's checkpoint": {"model.init_from": SOURCE},
        "the book's chapter 7 data": {"data.chat.records": "book"},
        "they are left out (too_long: drop)": {"data.chat.too_long": "drop"},
        "Every weight trains, with Muon and AdamW at 1e-3": {
            "model.lora_rank": 0, "model.optimizer": "muon", "model.learning_rate": 1e-3,
            "model.muon_learning_rate": 1e-3},
        "compiled, batch 24": {"model.compile": True, "data.loader.batch_size": 24},
    },
    "sft-addition": {
        "A short fine-tune of the default run's checkpoint": {"model.init_from": SOURCE},
        "multi-digit addition": {"data.chat.records": "task:addition"},
        "answers alone, 150 steps": {"trainer.max_steps": 150},
        "Every weight trains, with Muon and AdamW at 1e-3, batch 24, compiled": {
            "model.lora_rank": 0, "model.optimizer": "muon", "model.learning_rate": 1e-3,
            "model.muon_learning_rate": 1e-3, "data.loader.batch_size": 24,
            "model.compile": True},
    },
    "dpo-shakespeare": {
        "from the instruction-tuned default run": {
            "model.init_from": "runs/instruct-shakespeare/checkpoints/best.ckpt"},
        "the book's 1,100 preference pairs": {"data.preference.records": "book"},
        "the book's variant (log-probabilities averaged per token) at beta 0.5": {
            "model.dpo.variant": "book", "model.dpo.beta": 0.5},
        "every weight trains, with AdamW at 6e-4, batch 8 pairs, 200 steps": {
            "model.lora_rank": 0, "model.optimizer": "adamw", "model.learning_rate": 6e-4,
            "data.loader.batch_size": 8, "trainer.max_steps": 200},
        "(too_long: drop)": {"data.preference.too_long": "drop"},
    },
    "grpo-addition": {
        "GRPO on the arithmetic task": {"data.rl.task": "addition"},
        "from the short fine-tune": {
            "model.init_from": "runs/sft-addition/checkpoints/last.ckpt"},
        "200 held-out prompts": {"data.rl.heldout": 200},
        "groups of 8 answers to 16 prompts": {"model.grpo.group_size": 8,
                                              "data.loader.batch_size": 16},
        "one inner step": {"data.rl.inner_steps": 1},
        "with AdamW at 5e-6, 200 steps": {"model.lora_rank": 0, "model.optimizer": "adamw",
                                          "model.learning_rate": 5e-6,
                                          "trainer.max_steps": 200},
        "the KL term is off": {"model.grpo.kl_weight": 0.0},
    },
    "lora-shakespeare": {
        "rank-8 adapters on the attention's four projections": {
            "model.lora_rank": 8, "model.lora_targets": ["W_query", "W_key", "W_value",
                                                         "out_proj"]},
        "of the default run's checkpoint": {"model.init_from": SOURCE},
        "with AdamW": {"model.optimizer": "adamw"},
    },
}
CPU_CHOICES = {"model.n_kv_heads": 1, "model.attention_backend": "explicit",
               "trainer.accelerator": "cpu"}
"""The default run's choices for a CPU (one key/value head is faster there; the explicit
kernel beats sdpa's at 128 tokens on a CPU, and materializes every score on a GPU)."""


def resolve(*args: str) -> dict:
    """What `train.py ARGS --print_config` prints, as a dict."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), pytest.raises(SystemExit):
        build_cli([*args, "--print_config"])
    return yaml.safe_load(printed.getvalue())


def setting(config: dict, key: str):
    for part in key.split("."):  # model.n_heads, data.loader.batch_size
        config = config[part]
    return config


def header(path: Path) -> str:
    """The comment atop a config, its lines joined into one text."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    return re.sub(r"\s+", " ", " ".join(lines))


@pytest.fixture(scope="module")
def resolved() -> dict[str, dict]:
    """Every config of configs/ as train.py resolves it, and the default run ("default")."""
    return {"default": resolve(), **{c.stem: resolve("--config", str(c)) for c in CONFIGS}}


def test_every_config_has_its_header_claims_listed():
    assert sorted(HEADERS) == sorted(c.stem for c in CONFIGS)


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_a_configs_header_is_true_of_the_config_train_py_resolves(config, resolved):
    said = header(config)
    assert f"python train.py --config configs/{config.name}" in said  # how it runs
    for phrase, claims in HEADERS[config.stem].items():
        assert phrase in said, f"{config.name}'s header no longer says {phrase!r}"
        for key, value in claims.items():
            if value is DEFAULT_RUN:
                value = setting(resolved["default"], key)
            assert setting(resolved[config.stem], key) == value, f"{config.name}: {key}"


def test_no_gpu_config_carries_a_cpu_choice(resolved):
    gpu = {name: run for name, run in resolved.items() if run["trainer"]["accelerator"] == "gpu"}
    assert {"shakespeare-gpu", "gpt2-124m-fineweb", "gpt2-finetune-shakespeare"} <= set(gpu)
    for name, run in gpu.items():
        for key, cpu in CPU_CHOICES.items():
            assert setting(run, key) != cpu, f"{name}: {key}={cpu!r} is the CPU's choice"
        heads = run["model"]["n_kv_heads"]
        assert heads in (None, run["model"]["n_heads"]), f"{name}: GQA, claimed nowhere"


def test_a_config_file_is_a_whole_run_not_changes_to_the_default_run(tmp_path, resolved):
    mine = tmp_path / "mine.yaml"
    mine.write_text("model:\n  n_layers: 2\n")
    classes = resolve("--config", str(tmp_path / "mine.yaml"))
    empty = tmp_path / "empty.yaml"
    empty.write_text("{}\n")
    assert classes["model"] == {**resolve("--config", str(empty))["model"], "n_layers": 2}
    assert classes["model"]["n_kv_heads"] != resolved["default"]["model"]["n_kv_heads"]
    # The classes' defaults are the book's GPT-2 124M, trained with AdamW.
    assert {k: classes["model"][k] for k in ("emb_dim", "n_heads", "context_length")} == {
        k: GPT_CONFIG_124M[k] for k in ("emb_dim", "n_heads", "context_length")}
    assert classes["model"]["optimizer"] == "adamw"
    for spelled in (["-c", str(mine)], [f"-c{mine}"], [f"--config={mine}"]):
        assert resolve(*spelled)["model"] == classes["model"], spelled  # argparse's forms
    # To build on the default run, a file names it: its YAML first.
    on_top = resolve("--config", str(DEFAULT_CONFIG), "--config", str(mine))
    assert on_top["model"] == {**resolved["default"]["model"], "n_layers": 2}
    # Flags alone still change the default run.
    assert resolve("--model.n_layers", "2")["model"] == on_top["model"]


def test_book_gpt2_yaml_pins_nothing_it_would_have_anyway(tmp_path):
    """The defect: layered on the default run, book-gpt2.yaml pinned 20 keys to undo it."""
    empty = tmp_path / "empty.yaml"
    empty.write_text("{}\n")
    classes = resolve("--config", str(empty))
    written = yaml.safe_load((REPO / "configs" / "book-gpt2.yaml").read_text())

    def pinned(written: dict, where: str = "") -> list[str]:
        keys = []
        for key, value in written.items():
            if isinstance(value, dict):
                keys += pinned(value, f"{where}{key}.")
            elif setting(classes, f"{where}{key}") == value:
                keys.append(f"{where}{key}")
        return keys

    assert pinned(written) == []
