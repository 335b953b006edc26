"""The run resolved once (`gptmini.train.plan`): the model and the data receive the plan's
objects, a data module built in Python picks what train.py picks, and "auto" is one rule,
the source model's own template first."""

import errno
import json
import os
from pathlib import Path

import pytest
import torch
from helpers import save_checkpoint, tiny_args

from gptmini.chat import BOOK, GPTMINI
from gptmini.data import Corpus, GPTDataModule, Loader, Windows
from gptmini.data.chat import Chat
from gptmini.data.labels import Labels
from gptmini.model import GPTConfig, GPTModel
from gptmini.train.command import build_cli
from gptmini.train.plan import on_cpu, save_template

ALPACA = [{"instruction": "Name a colour.", "input": "", "output": "Blue."}] * 40
CHAT = [{"messages": [{"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello."}]}] * 40


def records(tmp_path, name: str, rows: list) -> str:
    path = tmp_path / name
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return str(path)


def python_datamodule(cli, **parts) -> GPTDataModule:
    """The data module a user builds in Python from the same data settings as `cli`'s,
    without the plan (the tokenizer as the run saved it)."""
    data = cli.config.data
    corpus = Corpus(**{**data.corpus.as_dict(), "tokenizer": cli.config.model.tokenizer})
    return GPTDataModule(corpus,
                         Windows(**data.windows.as_dict()), Loader(**data.loader.as_dict()),
                         **parts)


@pytest.mark.parametrize(("rows", "template"), [(ALPACA, BOOK), (CHAT, GPTMINI)])
def test_a_datamodule_built_in_python_picks_the_template_train_py_picks(tmp_path, corpus,
                                                                        rows, template):
    path = records(tmp_path, "records.jsonl", rows)
    cli = build_cli(tiny_args(tmp_path, corpus, "--data.chat.records", path,
                              "--model.context_length", "64"))
    assert cli.plan.chat_template == template
    # one tokenizer object, resolved once, in the module and the data alike
    assert cli.model.tokenizer is cli.datamodule.tokenizer is cli.plan.tokenizer
    cli.datamodule.setup("fit")
    mine = python_datamodule(cli, chat=Chat(records=path))  # template "auto", as given
    mine.setup("fit")
    assert mine.chat_template == cli.datamodule.chat_template == template
    assert mine.tokenizer.n_vocab == cli.model.tokenizer.n_vocab


def test_a_datamodule_built_in_python_finds_the_classes_train_py_finds(tmp_path, corpus):
    path = tmp_path / "labelled.jsonl"
    path.write_text("\n".join(json.dumps({"text": f"text {i}", "label": "ab"[i % 2]})
                              for i in range(40)))
    args = tiny_args(tmp_path, path, "--data.labels.label_field", "label")
    cli = build_cli(args)
    assert cli.plan.classes == ("a", "b") and cli.model.task.classes == ("a", "b")
    mine = python_datamodule(cli, labels=Labels(label_field="label"))
    assert tuple(mine.class_names()) == cli.plan.classes


def test_auto_takes_the_source_models_own_template_over_the_records_kind(tmp_path, corpus):
    """A chat-tuned source carries the book's template; chat records alone would pick
    gptmini's: the run keeps the source's format (before, a data module built without the
    command line picked by the records)."""
    torch.manual_seed(0)
    source = GPTModel(GPTConfig(vocab_size=50257, context_length=16, emb_dim=32, n_heads=2,
                                n_layers=2, drop_rate=0.0))
    path = save_checkpoint(source, tmp_path / "source.ckpt")
    ckpt = torch.load(path, weights_only=True)
    ckpt["chat_template"] = BOOK.to_dict()
    torch.save(ckpt, path)
    cli = build_cli(tiny_args(tmp_path, corpus, "--model.init_from", str(path),
                              "--data.chat.records", records(tmp_path, "c.jsonl", CHAT)))
    assert cli.plan.source.chat_template == BOOK and cli.plan.chat_template == BOOK
    assert cli.datamodule.chat_template is cli.plan.chat_template
    # the run's config names what was chosen, so its saved config and hparams read true
    assert cli.config.data.chat.template == "book"
    assert cli.plan.tokenizer.n_vocab == 50257  # the book's template adds no tokens


def test_the_model_and_data_objects_are_no_flags_and_print_config_stays_a_config(capsys):
    with pytest.raises(SystemExit):
        build_cli(["--print_config"])
    printed = capsys.readouterr().out
    assert "encoding" not in printed.replace("encoding_errors", "")
    assert "chat_template" not in printed
    with pytest.raises(SystemExit):
        build_cli(["--model.encoding", "gpt2"])


def test_either_classes_flag_orders_the_head_and_two_that_differ_are_refused(tmp_path):
    """--model.classes used to be overwritten by the training records' labels (issue 48)."""
    path = tmp_path / "labelled.jsonl"
    path.write_text("\n".join(json.dumps({"text": f"text {i}", "label": "ab"[i % 2]})
                              for i in range(40)))
    args = tiny_args(tmp_path, path, "--data.labels.label_field", "label")
    for flag in ("--model.classes", "--data.labels.classes"):
        assert build_cli([*args, flag, "[b, a]"]).plan.classes == ("b", "a")
    with pytest.raises(ValueError, match="--model.classes .* and --data.labels.classes .* "
                                         "differ"):
        build_cli([*args, "--model.classes", "[b, a]", "--data.labels.classes", "[a, b]"])


def test_a_chat_template_that_cannot_be_saved_is_named(tmp_path, monkeypatch):
    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Path, "write_text", full)
    path = tmp_path / "run" / "chat_template.json"
    with pytest.raises(OSError, match=f"could not write the chat template {path} \\(No space"):
        save_template(GPTMINI, path)


def default_run_args(tmp_path, corpus, *flags: str) -> list[str]:
    """The default run (its config, no --config) on a small corpus, as a user starts it."""
    return ["--trainer.default_root_dir", str(tmp_path / "runs"), "--run_name", "d",
            "--model.tokenizer", "byte", "--data.corpus.source", str(corpus),
            "--data.corpus.cache_dir", str(tmp_path / "cache"), *flags]


@pytest.mark.parametrize(("has_bf16", "flags", "steps"), [
    (True, (), 960),                                    # the recipe as timed
    (False, (), 450),                                   # an AVX2 CPU: float32, fewer steps
    (True, ("--trainer.precision", "32-true"), 450),    # float32 asked for: as slow
    (False, ("--trainer.max_steps", "960"), 960),       # the steps given win
    (False, ("--trainer.max_steps", "300"), 300),
    (False, ("--cpu_float32_steps", "null"), 960),      # the rule off
])
def test_the_default_run_trains_fewer_steps_where_a_cpu_trains_in_float32(
        tmp_path, corpus, monkeypatch, has_bf16, flags, steps):
    """Issue 48: the default's minutes were timed with bf16 matmuls; a CPU without bf16 units
    trains it in float32 several times slower, so the default trains --cpu_float32_steps
    there, decided by the CPU and the precision alone (the same command, the same steps)."""
    monkeypatch.setattr("gptmini.runtime.cpu_has_bf16", lambda: has_bf16)
    # (this corpus is tiny: the epoch cap, tested below, would cut any count)
    cli = build_cli(default_run_args(tmp_path, corpus, "--max_corpus_epochs", "null", *flags))
    assert cli.config.trainer.max_steps == steps
    assert cli.trainer.max_steps == steps


@pytest.mark.parametrize(("has_bf16", "flags", "compiled"), [
    (True, (), True),                                   # bf16: compiling pays
    (False, (), False),                                 # an AVX2 CPU: float32, eager
    (True, ("--trainer.precision", "32-true"), False),  # float32 asked for: the same
    (False, ("--model.compile", "true"), True),         # compile given wins
    (False, ("--cpu_float32_compile", "null"), True),   # the rule off
])
def test_the_default_run_trains_eagerly_where_a_cpu_trains_in_float32(
        tmp_path, corpus, monkeypatch, capsys, has_bf16, flags, compiled):
    """Issue 54: in float32 the matmuls are the step and compiling saved less than its first
    step cost, so the default trains eagerly there (--cpu_float32_compile), saying so."""
    monkeypatch.setattr("gptmini.runtime.cpu_has_bf16", lambda: has_bf16)
    cli = build_cli(default_run_args(tmp_path, corpus, *flags))
    assert cli.config.model.compile is compiled
    assert cli.model.hparams.compile is compiled
    said = "compile: off (--cpu_float32_compile false: in float32 on a CPU the matmuls"
    assert (said in capsys.readouterr().out) == (not compiled)


@pytest.mark.parametrize(("flags", "capped"), [
    ((), True),                                          # the default: at most its epochs
    (("--max_corpus_epochs", "2.5"), True),
    (("--trainer.max_steps", "300"), False),             # the steps given win
    (("--max_corpus_epochs", "null"), False),            # the rule off
])
def test_a_small_corpus_trains_at_most_max_corpus_epochs(tmp_path, corpus, monkeypatch, capsys,
                                                         flags, capped):
    """Issue 54: the default run's steps follow the corpus's size, counted before the run
    starts (its training tokens, the batch), said in one line naming the flag."""
    monkeypatch.setattr("gptmini.runtime.cpu_has_bf16", lambda: True)
    cli = build_cli(default_run_args(tmp_path, corpus, *flags))
    epochs = cli.config.max_corpus_epochs or 3  # (the rule off: what it would have said)
    data = cli.config.data
    tokens = len(Corpus(**{**data.corpus.as_dict(), "tokenizer": "byte"}).tokens()[0])
    per_step = data.loader.batch_size * cli.config.model.context_length
    want = int(-(-epochs * tokens // per_step)) if capped else int(dict(
        zip(flags[::2], flags[1::2], strict=True)).get("--trainer.max_steps", 960))
    assert cli.trainer.max_steps == cli.config.trainer.max_steps == want
    said = f"steps: {want} (--max_corpus_epochs {epochs:g}: the corpus's {tokens:,} training"
    assert (said in capsys.readouterr().out) == capped
    assert not capped or 0 <= want * per_step / tokens - epochs < per_step / tokens


def test_a_corpus_the_recipe_fits_keeps_its_steps_and_records_are_not_capped(
        tmp_path, corpus, monkeypatch):
    monkeypatch.setattr("gptmini.runtime.cpu_has_bf16", lambda: True)
    cli = build_cli(default_run_args(tmp_path, corpus, "--max_corpus_epochs", "1e6"))
    assert cli.trainer.max_steps == 960
    path = records(tmp_path, "chat.jsonl", CHAT)
    cli = build_cli(default_run_args(tmp_path, corpus, "--data.chat.records", path,
                                     "--run_name", "chat"))
    assert cli.trainer.max_steps == 960


def test_max_corpus_epochs_not_positive_is_refused(tmp_path, corpus):
    with pytest.raises(ValueError, match=r"--max_corpus_epochs=0.0 is invalid: use a positive"):
        build_cli(default_run_args(tmp_path, corpus, "--max_corpus_epochs", "0"))


def test_only_a_run_on_the_cpu_counts_as_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert on_cpu("cpu") and not on_cpu("auto") and not on_cpu("gpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert on_cpu("auto")


def test_a_config_file_run_keeps_its_steps_in_float32(tmp_path, corpus, monkeypatch):
    """A --config file is a whole run on the classes' defaults: no float32 rule unless it
    sets one."""
    monkeypatch.setattr("gptmini.runtime.cpu_has_bf16", lambda: False)
    config = tmp_path / "run.yaml"
    config.write_text("trainer:\n  max_steps: 50\nmodel:\n  tokenizer: byte\n")
    cli = build_cli(["--config", str(config), *default_run_args(tmp_path, corpus)])
    assert cli.trainer.max_steps == 50


def test_cpu_float32_steps_below_one_is_refused(tmp_path, corpus):
    with pytest.raises(ValueError, match=r"--cpu_float32_steps=0 is invalid: use 1 or more"):
        build_cli(default_run_args(tmp_path, corpus, "--cpu_float32_steps", "0"))
