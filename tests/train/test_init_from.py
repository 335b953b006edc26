"""--model.init_from: a gptmini checkpoint or a Hugging Face directory starts a run, which
takes the architecture and the tokenizer from it; a flag that contradicts it is refused."""

import pytest
import torch
from helpers import save_checkpoint, tiny_args

from gptmini.checkpoint import load_checkpoint
from gptmini.convert import export_hf
from gptmini.model import GPTConfig, GPTModel
from gptmini.tokenizer import get_tokenizer
from gptmini.train.command import build_cli, main

# The source: the book's GPT-2 blocks, while the default run has Qwen3's; nothing of it is
# repeated on the command line.
SOURCE = dict(vocab_size=50257, context_length=16, emb_dim=32, n_heads=2, n_layers=3,
              drop_rate=0.0, qkv_bias=True, position="learned", norm="layernorm", mlp="gelu")
ARCHITECTURE_FLAGS = ("--model.context_length", "--model.emb_dim", "--model.n_heads",
                      "--model.n_layers", "--model.tokenizer")


def finetune_args(tmp_path, corpus, *extra: str) -> list[str]:
    """The tests' tiny run without its architecture and tokenizer flags."""
    args = tiny_args(tmp_path, corpus)
    keep = []
    for i, arg in enumerate(args):
        if arg in ARCHITECTURE_FLAGS or (i and args[i - 1] in ARCHITECTURE_FLAGS):
            continue
        keep.append(arg)
    return [*keep, *extra]


def gptmini_source(tmp_path) -> tuple[GPTModel, str]:
    torch.manual_seed(7)
    model = GPTModel(GPTConfig(**SOURCE)).eval()
    return model, str(save_checkpoint(model, tmp_path / "source.ckpt"))


def test_a_gptmini_checkpoint_gives_the_run_its_architecture_tokenizer_and_weights(
        tmp_path, corpus):
    source, path = gptmini_source(tmp_path)
    cli = build_cli(finetune_args(tmp_path, corpus, "--model.init_from", path,
                                  "--model.drop_rate", "0.1", "--model.context_length", "8"))
    module = cli.model
    expected = GPTConfig(**{**SOURCE, "drop_rate": 0.1, "context_length": 8})
    assert module.cfg == expected and module.tokenizer.name == "gpt2"
    assert cli.datamodule.windows.max_length == 8
    module.load_pretrained(path)
    ours = module.model.eval()
    idx = torch.randint(0, 50257, (2, 8))
    torch.testing.assert_close(ours(idx), source(idx))  # the source's weights, cropped context


@pytest.mark.parametrize("flag, value, theirs", [
    ("--model.n_layers", "2", "n_layers=3"),
    ("--model.position", "rope", "position='learned'"),
    ("--model.context_length", "32", "context_length=16"),
    ("--model.tokenizer", "byte", "gpt2, 50,257 ids"),
])
def test_a_flag_that_contradicts_the_source_is_refused_naming_both_values(
        tmp_path, corpus, capsys, flag, value, theirs):
    _, path = gptmini_source(tmp_path)
    assert main(finetune_args(tmp_path, corpus, "--model.init_from", path, flag, value)) == 1
    err = capsys.readouterr().err
    assert f"{flag} {value}" in err and theirs in err and "Traceback" not in err
    assert not (tmp_path / "runs" / "tiny" / "checkpoints").exists()


def test_a_flag_that_agrees_with_the_source_is_taken(tmp_path, corpus):
    _, path = gptmini_source(tmp_path)
    cli = build_cli(finetune_args(tmp_path, corpus, "--model.init_from", path,
                                  "--model.n_layers", "3", "--model.tokenizer", "gpt2"))
    assert cli.model.cfg.n_layers == 3


@pytest.mark.slow
def test_a_transformers_qwen3_directory_starts_a_run_with_its_own_tokenizer(tmp_path, corpus):
    """A directory `transformers` itself wrote (Qwen3, byte-level vocabulary), trained two
    steps with no architecture flag; the checkpoint holds its vocabulary."""
    transformers = pytest.importorskip("transformers")
    cfg = GPTConfig(vocab_size=257, context_length=32, emb_dim=32, n_heads=4, n_layers=2,
                    drop_rate=0.0, position="rope", norm="rmsnorm", mlp="swiglu", bias=False,
                    qk_norm=True, norm_eps=1e-6, tie_weights=True)
    torch.manual_seed(2)
    export_hf(GPTModel(cfg), tmp_path / "export", get_tokenizer("byte"))
    hf = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "export")
    hf.save_pretrained(tmp_path / "qwen3")
    (tmp_path / "qwen3" / "tokenizer.json").write_bytes(
        (tmp_path / "export" / "tokenizer.json").read_bytes())
    source = load_checkpoint(tmp_path / "qwen3").model
    args = finetune_args(tmp_path, corpus, "--model.init_from", str(tmp_path / "qwen3"),
                         "--model.context_length", "16", "--trainer.max_steps", "2",
                         "--checkpoint_every", "2", "--model.warmup_steps", "1")
    assert main(args) == 0
    trained, tokenizer, _ = load_checkpoint(tmp_path / "runs" / "tiny" / "checkpoints" /
                                            "last.ckpt")
    assert tokenizer.n_vocab == 257 and trained.cfg.qk_norm and trained.cfg.context_length == 16
    moved = [n for n, p in source.state_dict().items() if not torch.equal(
        p, trained.state_dict()[n])]
    assert moved and trained.cfg.emb_dim == 32  # trained from the source's shape
