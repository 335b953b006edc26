"""`generate.py --chat`: a conversation over piped stdin, on a scripted checkpoint whose
replies are known in advance (tests/helpers.py), so the printed text is checked exactly."""

import io
import os
import sys
from pathlib import Path

import pytest
import torch
from helpers import save_checkpoint, scripted_model

from gptmini.chat import BOOK, GPTMINI, add_template_tokens, render_chat
from gptmini.checkpoint import load_checkpoint
from gptmini.generate.chat import ChatSession, chat_loop
from gptmini.generate.command import generate_main
from gptmini.generate.engine import Engine
from gptmini.generate.sampling import SamplingParams
from gptmini.tokenizer import byte_tokenizer, tokenizer_to_dict

ENC = add_template_tokens(byte_tokenizer(), GPTMINI)
END = GPTMINI.stop_ids(ENC)[0]
SYSTEM = {"role": "system", "content": "Be brief."}
TALK = [("Hello", "Hi there"), ("How are you?", "Fine, thanks.")]


def conversation(turns, system=True) -> list[dict]:
    messages = [SYSTEM] if system else []
    for user, reply in turns:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    return messages


def ids(messages) -> list[int]:
    return render_chat(messages, ENC, GPTMINI, add_generation_prompt=True, mask=False).ids


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A checkpoint whose greedy replies are TALK's, turn by turn, after SYSTEM."""
    script = {}
    for k, (_, reply) in enumerate(TALK):
        prompt = ids(conversation(TALK[:k + 1])[:-1])
        script.update({len(prompt) - 1 + j: t for j, t in enumerate([*reply.encode(), END])})
    model = scripted_model(ENC.n_vocab, script, default=ord("x"))
    path = save_checkpoint(model, tmp_path_factory.mktemp("chat") / "chat.ckpt", "byte")
    saved = torch.load(path, weights_only=False)
    saved["tokenizer"] = tokenizer_to_dict(ENC)  # the byte vocabulary with the chat tokens
    # as train.py names a grown vocabulary: the run's own file, not the built-in "byte"
    saved["hyper_parameters"]["tokenizer"] = str(path.parent / "tokenizer.json")
    torch.save(saved, path)
    return path


def test_generate_py_chat_over_piped_stdin(checkpoint, monkeypatch, capsys):
    read, write = os.pipe()
    os.write(write, b"Hello\nHow are you?\n/reset\n\nHello\n")
    os.close(write)  # the end of input ends the chat
    with os.fdopen(read) as stdin:
        monkeypatch.setattr(sys, "stdin", stdin)
        assert generate_main(["--checkpoint", str(checkpoint), "--chat", "--system",
                              "Be brief.", "--temperature", "0"]) == 0
    printed = capsys.readouterr()
    assert printed.out == ("Hi there\nFine, thanks.\n(the conversation starts over)\n"
                           "Hi there\n")
    assert "chat template 'gptmini'" in printed.err


def test_each_turn_prefills_only_its_new_tokens_and_old_turns_are_forgotten(checkpoint):
    model, tokenizer, hparams = load_checkpoint(checkpoint)
    engine = Engine(model, tokenizer, max_batch=1)  # serve's and generate.py's block size
    session = ChatSession(engine, GPTMINI, SamplingParams(max_new_tokens=40), "Be brief.")
    assert "".join(session.reply("Hello")) == "Hi there"
    first = engine.num_prefilled
    assert first == len(ids(conversation(TALK[:1])[:-1]))
    assert "".join(session.reply("How are you?")) == "Fine, thanks."
    computed = first + len(b"Hi there")  # turn 1's prompt and reply tokens
    assert engine.num_prefilled - first == len(ids(conversation(TALK)[:-1])) - computed
    out = io.StringIO()
    chat_loop(session, ["x" * 40 + "\n"] * 2 + ["y" * 200 + "\n"], out)  # context 128
    printed = out.getvalue().splitlines()  # each reply runs to the end of the context
    assert printed[2] == "(the oldest 4 messages were forgotten to fit the context)"
    assert "leaving no room for a reply" in printed[3] and len(printed) == 4
    assert [m["content"][:1] for m in session.messages] == ["x"] * 4  # the long one not kept


@pytest.mark.parametrize(("argv", "message"), [
    (["--system", "hi"], "--system is the system prompt of --chat"),
    (["--chat", "--prompt", "x"], "not allowed with argument"),
])
def test_chat_flags_are_checked(checkpoint, capsys, argv, message):
    with pytest.raises(SystemExit):
        generate_main(["--checkpoint", str(checkpoint), *argv])
    assert message in capsys.readouterr().err


def test_a_checkpoint_tuned_on_the_books_template_is_said_to_carry_it(tmp_path, monkeypatch,
                                                                      capsys):
    """Before: a fine-tune on the book's records (its checkpoint carries the "book" template)
    was said to have "no chat template of its own": the note went by the template's name."""
    model = scripted_model(byte_tokenizer().n_vocab, {}, default=ord("x"))
    path = save_checkpoint(model, tmp_path / "book.ckpt", "byte")
    saved = torch.load(path, weights_only=False)
    saved["chat_template"] = BOOK.to_dict()  # as train.py saves an instruction fine-tune
    torch.save(saved, path)
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert generate_main(["--checkpoint", str(path), "--chat"]) == 0
    err = capsys.readouterr().err
    assert "chat template 'book' (the one this checkpoint was fine-tuned with)" in err
    assert "no chat template of its own" not in err


def test_a_pretrained_checkpoint_is_said_to_fall_back_to_the_books_prompt(tmp_path, monkeypatch,
                                                                          capsys):
    model = scripted_model(byte_tokenizer().n_vocab, {}, default=ord("x"))
    path = save_checkpoint(model, tmp_path / "plain.ckpt", "byte")
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert generate_main(["--checkpoint", str(path), "--chat"]) == 0
    assert "'book' (the book's instruction prompt: this checkpoint has no chat template of " \
           "its own" in capsys.readouterr().err


def test_a_template_that_fails_by_itself_ends_the_chat_naming_it(checkpoint, tmp_path,
                                                                 monkeypatch, capsys):
    """Every message would fail the same way: one line naming the template, exit 1 (before,
    a raw ZeroDivisionError)."""
    saved = torch.load(checkpoint, weights_only=False)
    saved["chat_template"] = {**GPTMINI.to_dict(), "name": "divides",
                              "source": "{{ messages | length / 0 }}"}
    broken = tmp_path / "broken.ckpt"
    torch.save(saved, broken)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello\nAgain\n"))
    assert generate_main(["--checkpoint", str(broken), "--chat"]) == 1
    err = capsys.readouterr().err
    assert "chat template 'divides' failed while rendering it (ZeroDivisionError" in err
    assert "Traceback" not in err
