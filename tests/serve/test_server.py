"""The completions server, called with the official openai client and with raw HTTP.

Every output is compared with the engine's offline output for the same request run alone
(float64 weights, so batching with other clients cannot flip a near-tie).
"""

import concurrent.futures
import json
import threading
import time

import pytest
import torch

from gptmini.generate.engine import Engine
from gptmini.model import GPTConfig, GPTModel
from gptmini.tokenizer import byte_tokenizer

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from gptmini.serve.app import choice_seed, create_app  # noqa: E402

ENC = byte_tokenizer()


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=ENC.n_vocab, context_length=64, emb_dim=32, n_heads=4,
                    n_layers=2, drop_rate=0.0)
    return GPTModel(cfg).double().eval()


def eventually(condition, seconds: float, failure: str) -> None:
    """Wait until `condition()` holds; fail with `failure` after `seconds`."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, failure
        time.sleep(0.02)


def start(model, max_batch=16, num_blocks=None, step_seconds=0.0, **options):
    """A server on 127.0.0.1, port 0, in a thread: (base url, engine, stop function).

    `step_seconds`: each engine step takes at least this long, so a test that needs a
    request still running after a while (a timeout, a queue) holds whatever the CPU's speed.
    """
    engine = Engine(model, ENC, block_size=4, max_batch=max_batch, num_blocks=num_blocks)
    if step_seconds:
        step = engine.step
        engine.step = lambda: (time.sleep(step_seconds), step())[1]
    app = create_app(engine, "tiny", **options)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    eventually(lambda: server.started or not thread.is_alive(), 120, "the server did not start")
    assert server.started, "the server did not start"
    port = server.servers[0].sockets[0].getsockname()[1]

    def stop():
        server.should_exit = True
        thread.join(timeout=10)

    return f"http://127.0.0.1:{port}", engine, stop


@pytest.fixture(scope="module")
def served(model):
    url, engine, stop = start(model)
    yield url, engine
    stop()


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=f"{served[0]}/v1", api_key="unused", max_retries=0,
                         timeout=60)


def offline(model, prompt: str, max_tokens: int, seed=None, **settings) -> str:
    """The engine's text for this request alone."""
    engine = Engine(model, ENC, block_size=4)
    request = engine.add_request(ENC.encode(prompt, allowed_special="all"),
                                 max_new_tokens=max_tokens, seed=seed,
                                 stop_ids=(ENC.eot_token,), **settings)
    while engine.has_work:
        engine.step()
    return request.text


@pytest.fixture(scope="module")
def endless(model) -> str:
    """A prompt whose greedy text runs 300 tokens without <|endoftext|>: a request that is
    surely still running when a test looks at it."""
    for letter in "abcdefgh":
        engine = Engine(model, ENC, block_size=4)
        request = engine.add_request(ENC.encode(letter * 40), max_new_tokens=300,
                                     stop_ids=(ENC.eot_token,))
        while engine.has_work:
            engine.step()
        if request.finish_reason == "length":
            return letter * 40
    raise AssertionError("no prompt runs long enough")


def test_the_pinned_client_still_offers_the_completions_api():
    assert callable(openai.OpenAI(api_key="x", base_url="http://127.0.0.1:9").completions.create)


def test_plain_completion_equals_the_offline_engine(client, model):
    done = client.completions.create(model="tiny", prompt="ROMEO:", max_tokens=12,
                                     temperature=0)
    assert done.choices[0].text == offline(model, "ROMEO:", 12, temperature=0.0)
    assert done.choices[0].finish_reason in ("length", "stop")
    assert done.usage.prompt_tokens == 6 and done.usage.completion_tokens <= 12


def test_streaming_sends_the_same_text_then_done(client, model):
    chunks = list(client.completions.create(model="tiny", prompt="JULIET:", max_tokens=15,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == offline(model, "JULIET:", 15, temperature=0.0)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")
    assert chunks[-1].usage.completion_tokens > 0


def test_n_seeded_choices_draw_from_seed_and_index(client, model):
    ask = dict(model="tiny", prompt=["a", "b"], max_tokens=10, temperature=1.0, n=3, seed=5)
    first = [c.text for c in client.completions.create(**ask).choices]
    assert first == [c.text for c in client.completions.create(**ask).choices]
    expected = [offline(model, p, 10, temperature=1.0, seed=choice_seed(5, i))
                for p in ("a", "b") for i in range(3)]
    assert first == expected and len(set(first)) > 1


def test_stop_strings_spanning_tokens_are_held_back_while_streaming(client, model, endless):
    full = offline(model, endless, 60, temperature=0.0)
    stop = next(full[k:k + 2] for k in range(1, len(full) - 1)
                if full[k:k + 2].isascii() and full[k:k + 2] not in full[:k + 1])
    expected = offline(model, endless, 60, temperature=0.0, stop=(stop,))
    assert expected == full[:full.index(stop)]
    ask = dict(model="tiny", prompt=endless, max_tokens=60, temperature=0, stop=[stop])
    plain = client.completions.create(**ask)
    streamed = client.completions.create(**ask, stream=True)
    assert plain.choices[0].text == expected and plain.choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected


def test_fifty_concurrent_requests_all_complete_each_as_alone(client, model):
    prompts = [f"Request {i}: " for i in range(50)]
    with concurrent.futures.ThreadPoolExecutor(50) as pool:
        texts = list(pool.map(lambda p: client.completions.create(
            model="tiny", prompt=p, max_tokens=10, temperature=0).choices[0].text, prompts))
    assert texts == [offline(model, p, 10, temperature=0.0) for p in prompts]


@pytest.mark.parametrize(("body", "status", "message", "param"), [
    ("{not json", 400, "not valid JSON", None),
    ({"model": "tiny", "prompt": "a", "logprobs": 21}, 400,
     "logprobs must be an integer in 0..20", "logprobs"),
    ({"model": "tiny", "prompt": "a", "return_token_ids": 1}, 400, "must be true or false",
     "return_token_ids"),
    ({"model": "tiny", "prompt": "a", "frequency_penalty": 0.5}, 400, "not supported",
     "frequency_penalty"),
    ({"model": "tiny", "prompt": "a", "tools": []}, 400, "unsupported field 'tools'", "tools"),
    ({"model": "nope", "prompt": "a"}, 404, "does not exist", "model"),
    ({"model": "tiny", "prompt": "a", "max_tokens": -1}, 400, "max_tokens", "max_tokens"),
    ({"model": "tiny", "prompt": "a", "temperature": -1}, 400, "temperature", "temperature"),
    ({"model": "tiny", "prompt": "a", "top_p": 3}, 400, "top_p", "top_p"),
    ({"model": "tiny", "prompt": "x" * 65}, 400, "context_length is 64", "prompt"),
    ({"model": "tiny", "prompt": []}, 400, "prompt must be", "prompt"),
    ({"model": "tiny", "prompt": "a", "n": 0}, 400, "n must be", "n"),
    # Before: the wrong JSON types below were read by truthiness or coercion, or failed.
    ({"model": "tiny", "prompt": "a", "stream": "false"}, 400, "(a string)", "stream"),
    ({"model": "tiny", "prompt": "a", "temperature": True}, 400, "(a boolean)", "temperature"),
    ({"model": "tiny", "prompt": "a", "temperature": "0.7"}, 400, "must be a number",
     "temperature"),
    ({"model": "tiny", "prompt": "a", "top_p": True}, 400, "must be a number", "top_p"),
    ({"model": "tiny", "prompt": "a", "top_k": 1.5}, 400, "top_k must be an integer", "top_k"),
    ({"model": "tiny", "prompt": "a", "max_tokens": "5"}, 400, "(a string)", "max_tokens"),
    ({"model": "tiny", "prompt": "a", "n": 2.0}, 400, "n must be an integer", "n"),
    ({"model": "tiny", "prompt": "a", "n": True}, 400, "(a boolean)", "n"),
    ({"model": "tiny", "prompt": "a", "seed": 2**70}, 400, "seed must be an integer of 64 bits",
     "seed"),
    ({"model": "tiny", "prompt": "a", "stream_options": ["include_usage"]}, 400,
     "stream_options must be an object", "stream_options"),
    ({"model": "tiny", "prompt": "a", "stream": True, "stream_options": {
        "include_usage": "yes"}}, 400, "must be true or false", "stream_options.include_usage"),
    ({"model": "tiny", "prompt": "a", "echo": 0}, 400, "echo=0 is not supported", "echo"),
    ({"model": "tiny", "prompt": "a", "best_of": True}, 400, "not supported", "best_of"),
    ({"model": 5, "prompt": "a"}, 400, "model must be a string", "model"),
    ({"model": "tiny", "prompt": "a", "user": 5}, 400, "user must be a string", "user"),
    ({"model": "tiny", "prompt": "a", "stop": 5}, 400, "stop must be", "stop"),
])
def test_bad_requests_get_openai_errors_and_the_server_goes_on(served, client, model, body,
                                                               status, message, param):
    url, _ = served
    content = body if isinstance(body, str) else json.dumps(body)
    answer = httpx.post(f"{url}/v1/completions", content=content,
                        headers={"content-type": "application/json"}, timeout=30)
    assert answer.status_code == status
    error = answer.json()["error"]
    assert message in error["message"] and error["param"] == param and error["type"]
    assert client.completions.create(model="tiny", prompt="ok", max_tokens=3,
                                     temperature=0).choices[0].text == offline(
        model, "ok", 3, temperature=0.0)


def test_special_tokens_in_a_prompt_encode_as_generate_py_encodes_them(client, model):
    """One rule (gptmini.tokenizer.encode_prompt): before, the server read every special
    token in a prompt and generate.py only <|endoftext|>."""
    from gptmini.generate.loop import stream_text

    done = client.completions.create(model="tiny", prompt="a<|endoftext|>b", max_tokens=8,
                                     temperature=0)
    assert done.usage.prompt_tokens == 3  # a, <|endoftext|>, b: not 15 characters
    assert done.choices[0].text == "".join(stream_text(model, ENC, "a<|endoftext|>b", 8))
    engine = Engine(model, ENC, block_size=4)
    alone = engine.add_request([97, ENC.eot_token, 98], max_new_tokens=8,
                               stop_ids=(ENC.eot_token,))
    while engine.has_work:
        engine.step()
    assert done.choices[0].text == alone.text


def test_a_400_names_the_field_its_check_looked_at(model):
    """Before, every refusal the engine raised was blamed on the prompt; a request longer
    than the KV pool is max_tokens' fault, and a sampling setting names itself
    (SamplingError.field), whatever its message says."""
    url, _, stop = start(model, num_blocks=2)  # 8 tokens of pool
    try:
        body = {"model": "tiny", "prompt": "abc", "max_tokens": 20}
        error = httpx.post(f"{url}/v1/completions", json=body).json()["error"]
        assert error["param"] == "max_tokens" and "whole KV pool" in error["message"]
        error = httpx.post(f"{url}/v1/completions", json={
            **body, "max_tokens": 2, "temperature": -0.5}).json()["error"]
        assert error["param"] == "temperature" and "finite number >= 0" in error["message"]
    finally:
        stop()


def test_unknown_routes_answer_in_openai_shape(served):
    url, _ = served
    nothing = httpx.post(f"{url}/v1/nothing", json={})
    assert nothing.status_code == 404 and "POST /v1/nothing" in nothing.json()["error"]["message"]
    wrong = httpx.get(f"{url}/v1/completions")
    assert wrong.status_code == 405 and "GET /v1/completions" in wrong.json()["error"]["message"]


def test_neutral_values_of_default_fields_are_accepted(client):
    done = client.completions.create(model="tiny", prompt="a", max_tokens=2, echo=False,
                                     logprobs=None, best_of=1, presence_penalty=0,
                                     frequency_penalty=0, logit_bias={}, user="me")
    assert len(done.choices) == 1


def test_models_and_health(served):
    url, engine = served
    assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "tiny"
    health = httpx.get(f"{url}/health").json()
    assert health["status"] == "ok" and health["free_blocks"] <= engine.blocks.num_blocks


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(served, endless):
    url, engine = served
    free = engine.blocks.num_free
    body = {"model": "tiny", "prompt": endless, "max_tokens": 10_000, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as answer:
        lines = answer.iter_lines()  # (kept: a dropped iterator closes the stream)
        next(lines)  # the first event: the request is running
        assert engine.blocks.num_free < free
    eventually(lambda: engine.blocks.num_free == free and not engine.running, 60,
               "the disconnected request kept its blocks")


def test_api_key_queue_limit_and_timeout(model, endless):
    # 10,000 steps of >= 10 ms: the long request outlasts the 2 s timeout on any CPU
    url, engine, stop = start(model, api_key="secret", max_pending=1, timeout=2.0,
                              step_seconds=0.01)
    try:
        body = {"model": "tiny", "prompt": "a", "max_tokens": 2}
        assert httpx.post(f"{url}/v1/completions", json=body).status_code == 401
        key = {"authorization": "Bearer secret"}
        assert httpx.post(f"{url}/v1/completions", json=body, headers=key).status_code == 200
        long = {**body, "prompt": endless, "max_tokens": 10_000, "stream": True,
                "temperature": 0}
        with httpx.stream("POST", f"{url}/v1/completions", json=long, headers=key,
                          timeout=30) as answer:
            lines = answer.iter_lines()
            next(lines)
            busy = httpx.post(f"{url}/v1/completions", json=body, headers=key)
            assert busy.status_code == 429 and busy.json()["error"]["type"] == "rate_limit_error"
        eventually(lambda: not engine.running, 60, "the closed stream kept running")
        slow = httpx.post(f"{url}/v1/completions", json={**long, "stream": False},
                          headers=key, timeout=30)
        assert slow.status_code == 504 and "longer than 2 s" in slow.json()["error"]["message"]
        with httpx.stream("POST", f"{url}/v1/completions", json=long, headers=key,
                          timeout=30) as answer:
            last = [line for line in answer.iter_lines() if line][-1]
        assert json.loads(last[6:])["error"]["type"] == "timeout_error"  # not [DONE]
    finally:
        stop()


def test_call_size_limits_auth_scheme_and_non_streaming_disconnects(model, endless):
    """Before: --max_pending counted calls, so one call of 2,000 prompts x n=16 queued 32,000
    requests ahead of every other client; `Authorization: bearer KEY` got a 401."""
    url, engine, stop = start(model, max_batch=4, api_key="secret", max_pending=12,
                              step_seconds=0.01)  # the long requests outlast 1 s anywhere
    key = {"authorization": "bearer  secret"}  # the scheme is case-insensitive (RFC 9110)
    try:
        small = {"model": "tiny", "prompt": "a", "max_tokens": 2}
        assert httpx.post(f"{url}/v1/completions", json=small, headers=key).status_code == 200
        wrong = httpx.post(f"{url}/v1/completions", json=small,
                           headers={"authorization": "Bearer secreT"})
        assert wrong.status_code == 401
        huge = httpx.post(f"{url}/v1/completions", headers=key,
                          json={**small, "prompt": ["a", "b", "c"], "n": 5})
        assert huge.status_code == 400 and huge.json()["error"]["param"] == "prompt"
        assert "15 completions (3 prompts x n=5)" in huge.json()["error"]["message"]
        assert "--max_pending" in huge.json()["error"]["message"]
        long = {"model": "tiny", "prompt": [endless, endless], "n": 5,
                "max_tokens": 10_000, "temperature": 0}  # 10: 4 running, 6 queued
        with httpx.stream("POST", f"{url}/v1/completions", json={**long, "stream": True},
                          headers=key, timeout=30) as streaming:
            lines = streaming.iter_lines()  # (kept: a dropped iterator closes the stream)
            next(lines)
            busy = httpx.post(f"{url}/v1/completions", headers=key,
                              json={**small, "n": 3})  # 10 + 3 > 12
            assert busy.status_code == 429
            assert "10 completions in flight" in busy.json()["error"]["message"]
        eventually(lambda: not engine.has_work, 60, "the closed stream kept running")
        with pytest.raises(httpx.ReadTimeout):  # a client that gives up
            httpx.post(f"{url}/v1/completions", json=long, headers=key, timeout=1.0)
        assert engine.waiting, "the test needs queued requests"
        eventually(lambda: not engine.has_work, 60,
                   "a client that gave up left its requests (queued ones too) in the engine")
    finally:
        stop()


def test_a_client_that_hangs_up_mid_body_logs_no_traceback(served):
    import logging
    import socket

    url, _ = served
    seen = []
    handler = logging.Handler()
    handler.emit = seen.append
    logger = logging.getLogger("uvicorn.error")
    logger.addHandler(handler)
    try:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                         b"application/json\r\ncontent-length: 1000\r\n\r\n{\"prom")
            time.sleep(0.3)
        time.sleep(0.5)
        assert httpx.get(f"{url}/health").status_code == 200
    finally:
        logger.removeHandler(handler)
    assert not [r for r in seen if r.levelno >= logging.ERROR], seen[0].getMessage()


def test_an_engine_failure_fails_its_requests_and_the_server_goes_on(model):
    url, engine, stop = start(model)
    step, calls = engine.step, []

    def failing_once():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("out of memory (simulated)")
        step()

    engine.step, free = failing_once, engine.blocks.num_free
    try:
        body = {"model": "tiny", "prompt": "a", "max_tokens": 4, "temperature": 0}
        failed = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert failed.status_code == 500
        assert "out of memory (simulated)" in failed.json()["error"]["message"]
        again = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert again.json()["choices"][0]["text"] == offline(model, "a", 4, temperature=0.0)
        assert engine.blocks.num_free == free and not engine.has_work
    finally:
        stop()


def test_a_seeded_response_says_whether_its_text_depends_on_the_batch(served, model):
    """float64 weights: batch_invariant true. float32: false, the documented rare flip
    (before, a client was told nothing and could take a float32 seed as reproducible)."""
    ask = {"model": "tiny", "prompt": "a", "max_tokens": 2, "temperature": 1.0}
    answer = httpx.post(f"{served[0]}/v1/completions", json={**ask, "seed": 1}, timeout=60)
    assert answer.json()["batch_invariant"] is True
    plain = httpx.post(f"{served[0]}/v1/completions", json=ask, timeout=60).json()
    assert "batch_invariant" not in plain  # no seed: no text promised
    url, _, stop = start(GPTModel(model.cfg).eval())  # float32
    try:
        answer = httpx.post(f"{url}/v1/completions", json={**ask, "seed": 1}, timeout=60)
        assert answer.json()["batch_invariant"] is False
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                          json={**ask, "seed": 1, "stream": True}) as events:
            chunks = [json.loads(line[6:]) for line in events.iter_lines()
                      if line.startswith("data: {")]
        assert chunks and all(c["batch_invariant"] is False for c in chunks)
    finally:
        stop()
