"""/v1/chat/completions with the official openai client and raw HTTP, on a scripted model
(tests/helpers.py: its greedy reply at each position is known in advance), so every answer
is checked against the exact text, ids and counts it must have: the template's rendering,
the stop at its end token, the usage, the second turn's prefill from the prefix cache."""

import json

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from helpers import scripted_model  # noqa: E402
from test_page import serve  # noqa: E402

from gptmini.chat import (  # noqa: E402
    BOOK,
    GPTMINI,
    ChatTemplate,
    add_template_tokens,
    render_chat,
)
from gptmini.generate.engine import Engine  # noqa: E402
from gptmini.serve.app import choice_seed, create_app  # noqa: E402
from gptmini.tokenizer import byte_tokenizer  # noqa: E402

ENC = add_template_tokens(byte_tokenizer(), GPTMINI)  # gptmini's template tokens added
END = GPTMINI.stop_ids(ENC)[0]
TURN1 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
REPLY1, REPLY2 = "Hi there", "Fine, thanks."
TURN2 = [*TURN1, {"role": "assistant", "content": REPLY1},
         {"role": "user", "content": "How are you?"}]


def rendered(messages, enc=ENC, template=GPTMINI) -> list[int]:
    return render_chat(messages, enc, template, add_generation_prompt=True, mask=False).ids


def script(prompt: list[int], reply: list[int]) -> dict[int, int]:
    """Positions -> next token, so that greedy decoding after `prompt` writes `reply`."""
    return {len(prompt) - 1 + j: token for j, token in enumerate(reply)}


@pytest.fixture(scope="module")
def model():
    return scripted_model(ENC.n_vocab, {
        **script(rendered(TURN1), [*REPLY1.encode(), END]),
        **script(rendered(TURN2), [*REPLY2.encode(), END])}, default=ord("x"))


@pytest.fixture(scope="module")
def served(model):
    engine = Engine(model, ENC, block_size=4)
    url, stop = serve(create_app(engine, "tiny"))
    yield url, engine
    stop()


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key="x", max_retries=0, timeout=60)


def test_a_chat_is_the_templates_rendering_and_stops_at_its_end_token(client):
    done = client.chat.completions.create(model="tiny", messages=TURN1, temperature=0,
                                          extra_body={"return_token_ids": True})
    choice = done.choices[0]
    assert done.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.message.content == REPLY1 and choice.finish_reason == "stop"
    assert done.prompt_token_ids == rendered(TURN1)  # vLLM's place for them
    assert choice.token_ids == list(REPLY1.encode())  # the end token is not the reply's
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (len(rendered(TURN1)),
                                                                        len(REPLY1))
    assert done.usage.total_tokens == len(rendered(TURN1)) + len(REPLY1)


def test_streaming_sends_the_role_the_pieces_the_finish_and_the_usage(client):
    chunks = list(client.chat.completions.create(
        model="tiny", messages=TURN1, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    deltas = [c.choices[0] for c in chunks if c.choices]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert deltas[0].delta.role == "assistant" and {d.delta.role for d in deltas[1:]} == {None}
    assert "".join(d.delta.content or "" for d in deltas) == REPLY1
    assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + ["stop"]
    assert chunks[-1].usage.completion_tokens == len(REPLY1)


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_either_max_tokens_field_cuts_the_reply_with_length(client, field):
    done = client.chat.completions.create(model="tiny", messages=TURN1, temperature=0,
                                          **{field: 2})
    assert done.choices[0].message.content == "Hi"
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 2


def test_stop_strings_and_n_seeded_choices(client, model):
    done = client.chat.completions.create(model="tiny", messages=TURN1, temperature=0,
                                          stop=[" th"])
    assert done.choices[0].message.content == "Hi" and done.choices[0].finish_reason == "stop"
    ask = dict(model="tiny", messages=TURN1, temperature=30.0, n=3, seed=5, max_tokens=6)
    texts = [c.message.content for c in client.chat.completions.create(**ask).choices]
    assert texts == [c.message.content for c in client.chat.completions.create(**ask).choices]
    engine = Engine(model, ENC, block_size=4)
    offline = [engine.add_request(rendered(TURN1), max_new_tokens=6, temperature=30.0,
                                  seed=choice_seed(5, i), stop_ids=(END,)) for i in range(3)]
    while engine.has_work:
        engine.step()
    assert texts == [r.text for r in offline] and len(set(texts)) > 1


def test_logprobs_and_top_logprobs_are_the_models_in_chats_shape(client, model):
    done = client.chat.completions.create(model="tiny", messages=TURN1, temperature=0,
                                          logprobs=True, top_logprobs=3, max_tokens=4)
    content = done.choices[0].logprobs.content
    ids = rendered(TURN1) + list(b"Hi t")
    with torch.no_grad():
        truth = torch.log_softmax(model(torch.tensor([ids]))[0].double(), -1)
    for k, entry in enumerate(content):
        row = truth[len(rendered(TURN1)) - 1 + k]
        assert entry.token == "Hi t"[k] and entry.bytes == [ord("Hi t"[k])]
        assert entry.logprob == pytest.approx(float(row[ord("Hi t"[k])]), rel=1e-6, abs=1e-6)
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            torch.topk(row, 3).values.tolist(), rel=1e-6)
    plain = client.chat.completions.create(model="tiny", messages=TURN1, max_tokens=1)
    assert plain.choices[0].logprobs is None


def test_the_second_turn_prefills_only_its_new_tokens(client, served):
    """Turn 1's prompt and reply stay in the prefix cache (its full blocks by name, its
    partly filled last block adopted), so turn 2 computes only what follows the reply's
    tokens: the reply's end token, the user's message, the assistant's opening."""
    _, engine = served
    first = client.chat.completions.create(model="tiny", messages=TURN1, temperature=0,
                                           extra_body={"return_token_ids": True})
    reply = first.choices[0].token_ids
    messages = [*TURN1, {"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "How are you?"}]
    assert messages == TURN2
    turn2 = rendered(TURN2)
    assert turn2[:len(first.prompt_token_ids) + len(reply) + 1] == [
        *first.prompt_token_ids, *reply, END]  # the template's rendering is a prefix
    before = engine.num_prefilled
    second = client.chat.completions.create(model="tiny", messages=TURN2, temperature=0)
    assert second.choices[0].message.content == REPLY2
    new = len(turn2) - len(first.prompt_token_ids) - len(reply)
    assert engine.num_prefilled - before == new == len(turn2) - 19 - 8
    assert second.usage.prompt_tokens == len(turn2)  # usage counts every prompt token


@pytest.mark.parametrize(("body", "message", "param"), [
    ({"messages": []}, "messages must be a non-empty list", "messages"),
    ({"messages": "Hello"}, "messages must be a non-empty list", "messages"),
    ({"messages": [{"content": "x"}]}, "messages[0] has no 'role'", "messages"),
    ({"messages": [{"role": "bot", "content": "x"}]}, 'messages[0].role is "bot"', "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content must be",
     "messages"),
    ({"messages": [{"role": "user", "content": "x" * 200}]}, "leaving no room", "messages"),
    ({"max_tokens": 500}, "context_length of 128; ask at most", "max_tokens"),
    ({"max_completion_tokens": 500}, "max_completion_tokens=500", "max_completion_tokens"),
    ({"max_tokens": 2, "max_completion_tokens": 3}, "differ", "max_tokens"),
    ({"top_logprobs": 2}, "needs logprobs: true", "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs must be an integer in 0..20",
     "top_logprobs"),
    ({"logprobs": "yes"}, "logprobs must be true or false", "logprobs"),
    ({"n": 0}, "n must be", "n"),
    ({"temperature": -1}, "temperature", "temperature"),
    ({"prompt": "x"}, "unsupported field 'prompt'", "prompt"),
    ({"tools": [{"type": "function"}]}, "not supported", "tools"),
    ({"messages": [*TURN1, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                   {"role": "user", "content": "And?"}]},
     "messages[2].tool_calls: tool calls are not supported", "messages"),  # not dropped
])
def test_bad_requests_are_400s_naming_the_field(served, body, message, param):
    url, engine = served
    answer = httpx.post(f"{url}/v1/chat/completions", timeout=30,
                        json={"model": "tiny", "messages": TURN1, **body})
    error = answer.json()["error"]
    assert answer.status_code == 400 and message in error["message"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert not engine.has_work


def test_a_template_that_fails_by_itself_is_a_500_naming_it(model):
    """The server's template is at fault, not the request: a 500 in OpenAI's shape that
    names it (before, an unhandled ZeroDivisionError)."""
    broken = ChatTemplate("divides-by-zero", "{{ 1 / 0 }}", stop=GPTMINI.stop)
    url, stop = serve(create_app(Engine(model, ENC, block_size=4), "tiny",
                                 chat_template=broken))
    try:
        answer = httpx.post(f"{url}/v1/chat/completions", timeout=30,
                            json={"messages": TURN1})
    finally:
        stop()
    error = answer.json()["error"]
    assert answer.status_code == 500 and error["type"] == "server_error"
    assert "chat template 'divides-by-zero' failed while rendering it (ZeroDivisionError" in (
        error["message"])


def test_the_openai_client_raises_the_400_and_an_unknown_model_is_a_404(client):
    with pytest.raises(openai.BadRequestError, match="use one of system, user, assistant"):
        client.chat.completions.create(model="tiny", messages=[{"role": "bot", "content": "x"}])
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="other", messages=TURN1)


def test_a_pretrained_model_without_chat_tokens_chats_through_the_books_prompt():
    """A tokenizer without gptmini's chat tokens gets the book's (Alpaca's) prompt, which
    any pretrained model can continue, and its reply ends at <|endoftext|>."""
    enc = byte_tokenizer()
    ids = rendered([{"role": "user", "content": "Hello"}], enc, BOOK)
    assert enc.decode(ids).endswith("### Instruction:\nHello\n\n### Response:\n")
    model = scripted_model(enc.n_vocab, script(ids, [*b"Yes", enc.eot_token]), ord("x"),
                           context_length=256)  # (the book's preamble: 145 bytes)
    url, stop = serve(create_app(Engine(model, enc, block_size=4), "book"))
    try:
        answer = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": "Hello"}], "temperature": 0,
            "return_token_ids": True, "stream": True})
        assert answer.status_code == 200, answer.text
        events = [json.loads(line[6:]) for line in answer.text.splitlines()
                  if line.startswith("data: {")]
    finally:
        stop()
    assert events[0]["prompt_token_ids"] == ids
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == "Yes"
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("template", [GPTMINI, BOOK], ids=["gptmini", "book"])
@pytest.mark.parametrize("vocabulary", ["gpt2", "byte"])
def test_a_turn_and_its_reply_are_a_token_prefix_of_the_next_turn(template, vocabulary):
    """What lets turn 2 reuse turn 1's cache: turn 1 rendered with the generation prompt,
    then the reply's own encoding and the end token, start turn 2's rendering, for replies
    with leading, trailing and doubled whitespace, newlines, nothing, and any script. (It
    fails where a model wrote a reply with other tokens than its text's encoding: the
    cache is then reused up to there; docs/serving.md.)"""
    from gptmini.tokenizer import get_tokenizer

    enc = get_tokenizer(vocabulary) if vocabulary == "gpt2" else byte_tokenizer()
    enc = add_template_tokens(enc, template)
    end = template.stop_ids(enc)[0]
    for reply in ["Hello there.", " leading", "\nnewline first", "ends\n", "", "héllo ✓ 日本",
                  "two  spaces  "]:
        turn2 = rendered([*TURN1, {"role": "assistant", "content": reply},
                          {"role": "user", "content": "More"}], enc, template)
        prefix = [*rendered(TURN1, enc, template), *enc.encode(reply), end]
        assert turn2[:len(prefix)] == prefix, reply
