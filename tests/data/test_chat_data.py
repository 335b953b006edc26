"""Chat and instruction records as training rows: the loss counts the assistant's tokens
alone (proven by gradients, multi-turn included), packed examples never see each other,
the book's split, and bad records named by file, line and field."""

import json

import pytest
import torch

from gptmini.chat import (
    BOOK,
    BOOK_RECORDS,
    GPTMINI,
    RenderedChat,
    add_template_tokens,
    read_records,
    render_chat,
    to_messages,
)
from gptmini.data import Corpus, GPTDataModule, Loader, Windows
from gptmini.data.chat import Chat, PackedExamples, PaddedExamples, render_records, split_records
from gptmini.model import GPTConfig, GPTModel, lm_loss
from gptmini.tokenizer import get_tokenizer

BYTE_CHAT = add_template_tokens(get_tokenizer("byte"), GPTMINI)
MULTI_TURN = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye?"},
              {"role": "assistant", "content": "Bye!"}]


def tiny_model(vocab: int, context: int = 64) -> GPTModel:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=vocab, context_length=context, emb_dim=16, n_heads=2,
                    n_layers=2, drop_rate=0.0)
    return GPTModel(cfg).double()


def gradients(model: GPTModel, inputs: list[int], targets: list[int]) -> list[torch.Tensor]:
    model.zero_grad()
    lm_loss(model, torch.tensor([inputs]), torch.tensor([targets])).backward()
    return [p.grad.clone() for p in model.parameters()]


def test_changing_any_non_assistant_target_changes_no_gradient_multi_turn_included():
    """The rows' targets come from the rendered ids; replace the next token at any position
    the assistant did not write and the gradient is bit-identical; replace one it wrote and
    the gradient moves (so the check can fail)."""
    rendered = render_chat(MULTI_TURN, BYTE_CHAT, GPTMINI)
    inputs, targets = rendered.inputs_and_targets()
    model = tiny_model(BYTE_CHAT.n_vocab)
    base = gradients(model, inputs, targets)
    others = [p for p in range(1, len(rendered.ids)) if not rendered.assistant_mask[p]]
    mine = [p for p in range(1, len(rendered.ids)) if rendered.assistant_mask[p]]
    assert len(others) > 20 and len(mine) == len("Hello.") + len("Bye!") + 2
    for p in [*others, mine[0], mine[-1]]:
        ids = list(rendered.ids)
        ids[p] = (ids[p] + 7) % 256  # another token as the target at position p - 1
        _, changed = RenderedChat(ids, rendered.assistant_mask).inputs_and_targets()
        grads = gradients(model, inputs, changed)
        same = all(torch.equal(a, b) for a, b in zip(base, grads, strict=True))
        assert same == (p in others), p
    # and the training rows hold exactly these targets
    packed = PackedExamples(render_records([("x", {"messages": MULTI_TURN})], BYTE_CHAT,
                                           GPTMINI, 64)[0], 64, pad_id=0)
    _, row_targets, _ = packed[0]
    assert row_targets[:len(targets)].tolist() == targets
    assert (row_targets[len(targets):] == -100).all()


def test_no_packed_example_attends_to_another():
    """Each example's logits in a packed row equal its logits alone (float64)."""
    records = [("r", {"instruction": f"Say {w}", "input": "", "output": w * (i + 1)})
               for i, w in enumerate(["yes", "no", "maybe", "so"])]
    examples, _ = render_records(records, BYTE_CHAT, BOOK, 1024)
    packed = PackedExamples(examples, 1024, pad_id=0)
    assert len(packed) == 1 and len(packed.rows[0]) == 4  # all four in one row
    model = tiny_model(BYTE_CHAT.n_vocab, 1024).eval()
    inputs, _, documents = packed[0]
    together = model(inputs[None], document_ids=documents[None])[0]
    at = 0
    for i in packed.rows[0]:
        alone = model(torch.tensor([examples[i].inputs]))[0]
        torch.testing.assert_close(together[at:at + len(alone)], alone)
        at += len(alone)


def test_padded_rows_hold_the_same_targets_padded_with_minus_100():
    examples, _ = render_records([("a", {"messages": MULTI_TURN}),
                                  ("b", {"messages": MULTI_TURN[1:3]})], BYTE_CHAT, GPTMINI, 99)
    padded = PaddedExamples(examples, pad_id=0)
    inputs, targets = padded.collate([padded[0], padded[1]])
    assert inputs.shape == targets.shape == (2, len(examples[0].inputs))
    assert targets[1].tolist() == examples[1].targets + [-100] * (
        len(examples[0].inputs) - len(examples[1].inputs))


def test_alpaca_records_render_as_the_books_prompt():
    messages = to_messages({"instruction": "Rewrite it.", "input": "hi", "output": "Hi."}, "r")
    text = BYTE_CHAT.decode(render_chat(messages, BYTE_CHAT, BOOK).ids)
    assert text == ("Below is an instruction that describes a task. Write a response that "
                    "appropriately completes the request.\n\n### Instruction:\nRewrite it."
                    "\n\n### Input:\nhi\n\n### Response:\nHi.<|endoftext|>")
    no_input = to_messages({"instruction": "Go.", "input": "", "output": "Gone."}, "r")
    assert "### Input" not in BYTE_CHAT.decode(render_chat(no_input, BYTE_CHAT, BOOK).ids)


def test_the_books_records_ship_and_split_85_5_10_in_order():
    records = read_records("book")
    assert len(records) == 1100 and (BOOK_RECORDS.parent / "NOTICE").is_file()
    train, val, test = split_records(records, (0.85, 0.05, 0.10))
    assert (len(train), len(test), len(val)) == (935, 110, 55)
    assert train[0] == records[0] and test[0] == records[935] and val[0] == records[1045]
    assert records[0][0] == f"{BOOK_RECORDS} line 2"  # where a record is, for its errors


def test_the_datamodule_trains_on_chat_records_with_the_auto_template(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps({"messages": MULTI_TURN})
                              for _ in range(40)) + "\n")
    for packing in (True, False):
        dm = GPTDataModule(Corpus(tokenizer="gpt2"), Windows(max_length=64), Loader(batch_size=4),
                           chat=Chat(records=str(path), template="book", packing=packing))
        dm.setup("fit")
        assert dm.chat_template is BOOK
        batch = next(iter(dm.train_dataloader()))
        assert len(batch) == (3 if packing else 2)
        assert (batch[1] != -100).any() and (batch[1] == -100).any()
        assert dm.val_dataset is not None


def write_lines(path, *records) -> str:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records))
    return str(path)


@pytest.mark.parametrize(("bad", "message"), [
    ({"messages": [{"content": "hi"}]}, r"line 2: messages\[0\] has no 'role'"),
    ({"messages": [{"role": "bot", "content": "hi"}]}, r"line 2: messages\[0\].role is \"bot\""),
    ({"messages": []}, "line 2: 'messages' must be a non-empty list"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "line 2: no 'assistant' message"),
    ({"text": "hi"}, "line 2: a record needs 'messages'"),
    ({"instruction": "x", "output": 3}, "line 2: 'output' must be a string"),
    ("{not json", "line 2: not JSON"),
    ({"messages": [{"role": "user", "content": "x" * 200},
                   {"role": "assistant", "content": "y"}]},
     "line 2: the record is 2\\d\\d tokens, past the context of 64"),
])
def test_bad_records_are_refused_naming_the_file_line_and_field(tmp_path, bad, message):
    good = {"messages": MULTI_TURN}
    source = write_lines(tmp_path / "bad.jsonl", good, bad)
    with pytest.raises(ValueError, match=f"bad.jsonl {message}"):
        render_records(read_records(source), BYTE_CHAT, GPTMINI, 64)


def test_too_long_records_can_be_dropped_and_are_counted(tmp_path):
    long = {"messages": [{"role": "user", "content": "x" * 200},
                         {"role": "assistant", "content": "y"}]}
    records = read_records(write_lines(tmp_path / "r.jsonl", {"messages": MULTI_TURN}, long))
    examples, dropped = render_records(records, BYTE_CHAT, GPTMINI, 64, "drop")
    assert (len(examples), dropped) == (1, 1)


def test_a_json_array_names_the_line_each_record_starts_on(tmp_path):
    path = tmp_path / "a.json"
    path.write_text('[\n  {"instruction": "a", "output": "b"},\n  {"instruction": 1,\n'
                    '   "output": "c"}\n]')
    records = read_records(path)
    assert [where for where, _ in records] == [f"{path} line 2", f"{path} line 3"]
    with pytest.raises(ValueError, match="a.json line 3: 'instruction' must be a string"):
        render_records(records, BYTE_CHAT, BOOK, 400)
