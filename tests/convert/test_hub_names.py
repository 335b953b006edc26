"""A model named on the Hugging Face Hub (`org/name`, `org/name@revision`) loads wherever a
checkpoint path goes, from huggingface_hub's cache (issue 55 item 2), tested on a cache laid
out as huggingface_hub lays it, offline: no test here reaches the network. What is not there
is named with its fix; a gated or private repository says how to log in."""

import shutil

import pytest
import torch

from gptmini.analysis.evaluate import evaluate_main
from gptmini.checkpoint import load_checkpoint, model_source
from gptmini.convert import export_hf, local_checkpoint
from gptmini.generate.command import generate_main
from gptmini.model import GPTConfig, GPTModel
from gptmini.tokenizer import get_tokenizer
from gptmini.train.source import Source, load_weights

hub = pytest.importorskip("huggingface_hub")
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """huggingface_hub's cache holding org/tiny at COMMIT (main points at it), read offline
    (HF_HUB_OFFLINE=1, as huggingface_hub reads it at import)."""
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(vocab_size=257, context_length=16, emb_dim=16, n_heads=2,
                               n_layers=1, drop_rate=0.0))
    export_hf(model, tmp_path / "export", get_tokenizer("byte"))
    repo = tmp_path / "hub" / "models--org--tiny"
    shutil.copytree(tmp_path / "export", repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setattr(hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)  # "org/tiny" is no path here
    return model, repo / "snapshots" / COMMIT


@pytest.mark.parametrize("name", ["org/tiny", "org/tiny@main", f"org/tiny@{COMMIT}"])
def test_a_cached_hub_name_loads_as_its_directory(cache, name):
    model, snapshot = cache
    assert local_checkpoint(name) == snapshot
    loaded = load_checkpoint(name)
    assert all(torch.equal(loaded.model.state_dict()[k], v)
               for k, v in model.state_dict().items())
    assert loaded.tokenizer.n_vocab == 257
    assert model_source(name)[0] == loaded.model.cfg  # what --model.init_from reads first
    assert Source.read(name).path == name  # the run records the name, not the cache
    fresh = GPTModel(loaded.model.cfg)
    load_weights(name, fresh, fresh=set())  # and then its weights
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())


def test_generate_py_and_evaluate_py_take_a_hub_name(cache, capsys, tmp_path):
    assert generate_main(["--checkpoint", "org/tiny", "--prompt", "hi", "--max_new_tokens",
                          "3", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("hi")
    (tmp_path / "text.txt").write_text("hello there, " * 20)
    assert evaluate_main(["--checkpoint", "org/tiny", "--data", str(tmp_path / "text.txt")]) == 0
    assert "bits per byte" in capsys.readouterr().out


def test_a_path_on_disk_wins_and_a_path_that_is_no_name_is_left_to_its_reader(cache, tmp_path):
    (tmp_path / "org" / "tiny").mkdir(parents=True)  # a directory of that name, here
    assert local_checkpoint("org/tiny").resolve() == tmp_path / "org" / "tiny"
    assert local_checkpoint("runs/x/checkpoints/last.ckpt").name == "last.ckpt"
    with pytest.raises(FileNotFoundError, match="no checkpoint at runs/x"):
        load_checkpoint("runs/x/checkpoints/last.ckpt")


@pytest.mark.parametrize(("name", "match"), [
    ("org/missing", r"org/missing is neither a file here nor in the Hugging Face cache .*"
                    r"HF_HUB_OFFLINE=1 reads the cache alone: download it once online"),
    ("org/tiny@v2", r"org/tiny@v2 is neither a file here nor in the Hugging Face cache"),
])
def test_what_the_cache_lacks_offline_is_named(cache, name, match):
    with pytest.raises(FileNotFoundError, match=match):
        load_checkpoint(name)


def test_a_cached_snapshot_without_weights_names_them(cache):
    _, snapshot = cache
    (snapshot / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"snapshot of org/tiny .* has no weights "
                                                r"\(model.safetensors"):
        load_checkpoint("org/tiny")


@pytest.mark.parametrize(("error", "match"), [
    ("GatedRepoError", r"org/gated is gated on the Hugging Face Hub: accept its terms on "
                       r"https://huggingface.co/org/gated, then log in first: `hf auth login`"),
    ("RepositoryNotFoundError", r"no model org/gated on the Hugging Face Hub, or a private "
                                r"one: check the name, or log in first"),
])
def test_a_gated_or_private_repository_says_how_to_log_in(cache, monkeypatch, error, match):
    import httpx

    def refused(*args, **kwargs):
        response = httpx.Response(401, request=httpx.Request("GET", "https://huggingface.co"))
        raise getattr(hub.errors, error)("refused", response=response)

    monkeypatch.setattr(hub, "snapshot_download", refused)
    with pytest.raises(ValueError, match=match):
        load_checkpoint("org/gated")
