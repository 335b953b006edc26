"""Preference pairs as training rows: both layouts read, the book's pairs shipped with their
NOTICE, the DPO loss reaching the response's tokens alone (proven by gradients), and every bad
record named by file, line, field and fix."""

import hashlib
import json

import pytest
import torch

from gptmini.chat import BOOK, BOOK_PREAMBLE, GPTMINI, ChatDataError, add_template_tokens
from gptmini.data.preference import (
    PREFERENCE_RECORDS,
    Preference,
    PreferencePairs,
    preference_datasets,
    read_pairs,
    render_pair,
    render_pairs,
    to_pair,
    to_pairs,
)
from gptmini.finetune.dpo import dpo_loss
from gptmini.finetune.reference import sequence_log_probs
from gptmini.model import GPTConfig, GPTModel
from gptmini.tokenizer import get_tokenizer

BYTES = get_tokenizer("byte")
BOOK_PAIR = {"instruction": "Fix it.", "input": "He go.", "output": "He goes.",
             "chosen": "He goes.", "rejected": "He goes, obviously."}


def tiny_model(vocab: int = BYTES.n_vocab, context: int = 512) -> GPTModel:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=vocab, context_length=context, emb_dim=16, n_heads=2,
                    n_layers=2, drop_rate=0.0)
    return GPTModel(cfg).double()


def test_the_book_pairs_ship_unchanged_with_their_notice():
    assert hashlib.sha256(PREFERENCE_RECORDS.read_bytes()).hexdigest() == (
        "305315abf14f65fa42c01a0877572f832606571c2a7d49f152ac1d758b16756e")
    notice = (PREFERENCE_RECORDS.parent / "NOTICE").read_text()
    assert "Apache\nLicense, Version 2.0" in notice and "Sebastian Raschka" in notice
    assert "preference/" in (PREFERENCE_RECORDS.parents[1] / "NOTICE").read_text()
    records = read_pairs("book")
    pairs, identical = to_pairs(records)
    assert len(records) == 1100 and len(pairs) == 1094 and identical == 6
    raw = json.loads(PREFERENCE_RECORDS.read_text())
    assert pairs[0].chosen == raw[0]["chosen"] and pairs[0].rejected == raw[0]["rejected"]


def test_the_book_split_is_cut_from_all_1100_records_as_the_book_cuts_it():
    """85% train, then 10% test, then the rest validation, in file order, before any pair
    is left out (so the held-out pairs are the book's)."""
    train, val, line = preference_datasets(Preference(records="book"), BYTES, BOOK, 1024)
    assert len(train) == 935 - 6 and len(val) == 1100 - 935 - 110  # the 6 are all in training
    assert "6 left out whose chosen and rejected are the same" in line
    raw = json.loads(PREFERENCE_RECORDS.read_text())
    first_val = raw[935 + 110]
    expected = render_pair(to_pair(first_val, "x"), BYTES, BOOK)
    assert val[0] == expected


@pytest.mark.parametrize("record", [
    {"prompt": "Fix it.\n\n### Input:\nHe go.", "chosen": "He goes.",
     "rejected": "He goes, obviously."},
    {"messages": [{"role": "user", "content": "Fix it.\n\n### Input:\nHe go."}],
     "chosen": [{"role": "assistant", "content": "He goes."}],
     "rejected": {"role": "assistant", "content": "He goes, obviously."}},
    {"prompt": [{"role": "user", "content": "Fix it.\n\n### Input:\nHe go."}],
     "chosen": "He goes.", "rejected": [{"role": "assistant", "content": "He goes, obviously."}]},
])
def test_the_chat_layouts_render_as_the_books_layout_does(record):
    book = render_pair(to_pair(BOOK_PAIR, "book"), BYTES, BOOK)
    assert render_pair(to_pair(record, "chat"), BYTES, BOOK) == book


def response_positions(prompt_text: str, response_text: str) -> tuple[list[int], list[int]]:
    """The book's own construction, by hand: the prompt's ids, then the response's and
    <|endoftext|>; the input positions whose next token is the response's (or its end)."""
    prompt = BYTES.encode(prompt_text)
    ids = prompt + BYTES.encode(response_text) + [BYTES.eot_token]
    return ids, list(range(len(prompt) - 1, len(ids) - 1))


def test_the_dpo_loss_reaches_the_responses_tokens_alone_proven_by_gradients():
    """Through the whole path (rendering, collate, log-probabilities, loss), the gradient
    at the logits is non-zero exactly at the positions whose next token is the response's
    or its stop token, for both responses; the book's prompt is built by hand as the oracle."""
    pair = to_pair(BOOK_PAIR, "x")
    prompt_text = (f"{BOOK_PREAMBLE}\n\n### Instruction:\nFix it.\n\n### Input:\nHe go."
                   "\n\n### Response:\n")
    model = tiny_model()
    logits = []

    def keep(module, args, out):
        out.retain_grad()
        logits.append(out)

    model.out_head.register_forward_hook(keep)
    rows = PreferencePairs([render_pair(pair, BYTES, BOOK)], pad_id=0)
    chosen_x, chosen_y, rejected_x, rejected_y = rows.collate([rows[0]])
    terms = dpo_loss(sequence_log_probs(model, chosen_x, chosen_y),
                     sequence_log_probs(model, rejected_x, rejected_y),
                     torch.tensor([-30.0]), torch.tensor([-45.0]))
    terms.loss.backward()
    for grad_of, inputs, response in ((logits[0], chosen_x, pair.chosen),
                                      (logits[1], rejected_x, pair.rejected)):
        ids, positions = response_positions(prompt_text, response)
        assert inputs[0, :len(ids) - 1].tolist() == ids[:-1]
        touched = grad_of.grad[0].abs().sum(-1).nonzero().flatten().tolist()
        assert touched == positions


def test_an_earlier_assistant_turn_of_the_prompt_gets_no_gradient():
    chat = add_template_tokens(BYTES, GPTMINI)
    record = {"messages": [{"role": "user", "content": "Hi"},
                           {"role": "assistant", "content": "Hello."},
                           {"role": "user", "content": "Bye?"}],
              "chosen": "Bye!", "rejected": "Go away."}
    rendered = render_pair(to_pair(record, "x"), chat, GPTMINI)
    counted = [t for t in rendered.chosen_targets if t != -100]
    assert chat.decode(counted) == "Bye!<|end|>"
    assert chat.decode([t for t in rendered.rejected_targets if t != -100]) == "Go away.<|end|>"


def test_summed_and_averaged_log_probs_against_log_softmax_by_hand():
    """The paper's sum and the book's per-token mean of the response's log-probabilities
    equal log_softmax of the model's logits gathered by hand (float64)."""
    model = tiny_model()
    inputs = torch.tensor([[5, 6, 7, 8, 9], [1, 2, 3, 0, 0]])
    targets = torch.tensor([[-100, -100, 8, 9, 10], [-100, 3, 4, -100, -100]])
    logp = torch.log_softmax(model(inputs), dim=-1)
    by_hand = [logp[0, 2, 8] + logp[0, 3, 9] + logp[0, 4, 10], logp[1, 1, 3] + logp[1, 2, 4]]
    summed = sequence_log_probs(model, inputs, targets)
    averaged = sequence_log_probs(model, inputs, targets, average=True)
    torch.testing.assert_close(summed, torch.stack(by_hand))
    torch.testing.assert_close(averaged, torch.stack([by_hand[0] / 3, by_hand[1] / 2]))


# ------------------------------------------------------------------------- bad records


@pytest.mark.parametrize(("record", "words"), [
    ({"instruction": "Fix it.", "chosen": "Same.", "rejected": "Same."},
     ["'chosen' and 'rejected' are the same text", "remove the record", "identical drop"]),
    ({"instruction": "Fix it.", "chosen": "  ", "rejected": "No."},
     ["'chosen' is empty", "write it, or remove the record"]),
    ({"prompt": "Fix it.", "chosen": "Yes.", "rejected": ""}, ["'rejected' is empty"]),
    ({"instruction": "Fix it.", "chosen": 3, "rejected": "No."},
     ["'chosen' must be a string", "got int"]),
    ({"instruction": "Fix it.", "chosen": "Yes."}, ["needs 'chosen', 'rejected' and a prompt",
                                                    "found ['chosen', 'instruction']"]),
    ({"prompt": "", "chosen": "Yes.", "rejected": "No."}, ["the prompt is empty"]),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}],
      "chosen": "Yes.", "rejected": "No."}, ["ends with an assistant message"]),
    ({"messages": [{"role": "robot", "content": "Hi"}], "chosen": "Yes.", "rejected": "No."},
     ["'messages': messages[0].role is \"robot\""]),
    ({"prompt": "Hi", "chosen": {"role": "user", "content": "Yes."}, "rejected": "No."},
     ["'chosen' must be the assistant's message"]),
    ("just text", ["needs 'chosen', 'rejected' and a prompt", "found str"]),
])
def test_a_bad_record_is_named_with_its_field_and_fix(tmp_path, record, words):
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(BOOK_PAIR) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(ChatDataError) as err:
        to_pairs(read_pairs(path))
    assert f"{path} line 2" in str(err.value)
    for word in words:
        assert word in str(err.value)


def test_identical_pairs_of_your_own_file_are_left_out_and_counted_when_asked(tmp_path):
    path = tmp_path / "pairs.jsonl"
    same = {"prompt": "Hi", "chosen": "Yo", "rejected": "Yo"}
    path.write_text("\n".join(json.dumps(r) for r in (BOOK_PAIR, same, BOOK_PAIR)) + "\n")
    pairs, dropped = to_pairs(read_pairs(path), identical="drop")
    assert (len(pairs), dropped) == (2, 1)
    _, _, line = preference_datasets(Preference(records=str(path), identical="drop",
                                                split=(1.0, 0.0, 0.0)), BYTES, BOOK, 512)
    assert "1 left out whose chosen and rejected are the same" in line


def test_a_pair_past_the_context_is_named_or_left_out_and_counted():
    pairs = [to_pair(BOOK_PAIR, "pairs.jsonl line 1"),
             to_pair({**BOOK_PAIR, "rejected": "x" * 400}, "pairs.jsonl line 2")]
    with pytest.raises(ChatDataError, match=r"pairs.jsonl line 2: .* past the context of 256"
                                            r".*--data.preference.too_long drop"):
        render_pairs(pairs, BYTES, BOOK, 256)
    kept, dropped = render_pairs(pairs, BYTES, BOOK, 256, too_long="drop")
    assert (len(kept), dropped) == (1, 1)


def test_missing_files_and_bad_settings_name_the_flag(tmp_path):
    with pytest.raises(FileNotFoundError, match="preference records nope.jsonl: no such file"):
        read_pairs("nope.jsonl")
    with pytest.raises(ValueError, match="--data.preference.identical 'skip': use 'error'"):
        Preference(records="book", identical="skip")
    with pytest.raises(ValueError, match="--data.preference.split"):
        Preference(records="book", split=(0.5, 0.1, 0.1))
