"""The server's logprobs (OpenAI's shape, N up to 20) and token ids, against the model's own
distribution computed here by one full forward pass (float64)."""

import json
import math

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from test_server import ENC, model, start  # noqa: E402, F401  (model: a fixture)

from gptmini.tokenizer import token_text  # noqa: E402


@pytest.fixture(scope="module")
def served(model):  # noqa: F811
    url, engine, stop = start(model)
    yield url
    stop()


def expected_logprobs(net, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """(len(tokens), vocab) log-probabilities of the next token before each generated one."""
    with torch.no_grad():
        logits = net(torch.tensor([prompt + tokens]))[0]  # (num_tokens, vocab)
    return torch.log_softmax(logits.double(), -1)[len(prompt) - 1:-1]


def test_logprobs_are_the_models_top_n_in_openais_shape(served, model):  # noqa: F811
    client = openai.OpenAI(base_url=f"{served}/v1", api_key="x", max_retries=0)
    done = client.completions.create(model="tiny", prompt="ROMEO:", max_tokens=10,
                                     temperature=0.9, seed=3, logprobs=20,
                                     extra_body={"return_token_ids": True})
    choice = done.choices[0]
    tokens, lp = choice.token_ids, choice.logprobs
    assert len(tokens) == len(lp.tokens) == len(lp.token_logprobs) == 10
    assert choice.prompt_token_ids == ENC.encode("ROMEO:")
    truth = expected_logprobs(model, ENC.encode("ROMEO:"), tokens)
    for k, token in enumerate(tokens):
        assert lp.tokens[k] == token_text(ENC, token)
        assert lp.token_logprobs[k] == pytest.approx(float(truth[k, token]), abs=1e-5)
        top = torch.topk(truth[k], 20)
        want = {token_text(ENC, int(i)): float(v) for i, v in zip(top.indices, top.values,
                                                                  strict=True)}
        want.setdefault(lp.tokens[k], float(truth[k, token]))  # the chosen one is always in
        assert lp.top_logprobs[k].keys() == want.keys()
        assert all(lp.top_logprobs[k][n] == pytest.approx(v, abs=1e-5) for n, v in want.items())
    assert lp.text_offset[0] == len("ROMEO:")
    # characters before each token: whole ones only (a byte of a longer character counts
    # when the character is complete or replaced, as in the text)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= 6 + len(
        choice.text)


def test_streamed_logprobs_and_ids_add_up_to_the_whole_answer(served):
    body = {"model": "tiny", "prompt": "JULIET:", "max_tokens": 12, "temperature": 0,
            "logprobs": 3, "return_token_ids": True}
    whole = httpx.post(f"{served}/v1/completions", json=body, timeout=30).json()["choices"][0]
    with httpx.stream("POST", f"{served}/v1/completions", json={**body, "stream": True},
                      timeout=30) as answer:
        chunks = [json.loads(line[6:]) for line in answer.iter_lines()
                  if line.startswith("data: {")]
    choices = [c["choices"][0] for c in chunks]
    assert [t for c in choices for t in c["token_ids"]] == whole["token_ids"]
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for c in choices for x in c["logprobs"][field]] == whole["logprobs"][field]
    assert all(len(top) in (3, 4) for top in whole["logprobs"]["top_logprobs"])
    greedy = whole["logprobs"]  # temperature 0: the chosen token is the most likely
    assert all(max(top.values()) == pytest.approx(lp) for top, lp in zip(
        greedy["top_logprobs"], greedy["token_logprobs"], strict=True))
    assert choices[0]["prompt_token_ids"] == ENC.encode("JULIET:")
    assert "prompt_token_ids" not in choices[1]


def test_logprobs_zero_gives_the_chosen_token_alone_and_none_gives_null(served):
    body = {"model": "tiny", "prompt": "a", "max_tokens": 4, "temperature": 0}
    zero = httpx.post(f"{served}/v1/completions", json={**body, "logprobs": 0}).json()
    tops = zero["choices"][0]["logprobs"]["top_logprobs"]
    assert [list(top) for top in tops] == [[t] for t in zero["choices"][0]["logprobs"]["tokens"]]
    assert all(math.isfinite(v) and v <= 0 for top in tops for v in top.values())
    plain = httpx.post(f"{served}/v1/completions", json=body).json()["choices"][0]
    assert plain["logprobs"] is None and "token_ids" not in plain
