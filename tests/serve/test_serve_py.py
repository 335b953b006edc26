"""serve.py as users run it: its own process, SIGTERM draining the requests in flight, and
its arguments' errors. (The routes themselves are tests/test_server.py's.)"""

import concurrent.futures
import json
import time

import pytest
import torch

from gptmini.generate.engine import Engine
from gptmini.model import GPTModel

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from helpers import HANG_SECONDS  # noqa: E402
from test_server import eventually  # noqa: E402

from gptmini.serve.app import choice_seed  # noqa: E402


@pytest.mark.slow
def test_sigterm_drains_the_stream_in_flight_then_exits(tmp_path):
    """serve.py as users run it: SIGTERM stops new connections, finishes the running stream
    to its [DONE], then exits."""
    import signal

    from helpers import save_checkpoint, start_serve_py, tiny

    torch.manual_seed(0)
    checkpoint = save_checkpoint(GPTModel(tiny()).eval(), tmp_path / "tiny.ckpt")
    server, url = start_serve_py(checkpoint, "--dtype", "float32", "--drain", str(HANG_SECONDS))
    try:
        deadline = time.monotonic() + HANG_SECONDS  # a hang guard, not a speed test
        while True:
            assert server.poll() is None, server.stdout.read()
            assert time.monotonic() < deadline, "serve.py did not start"
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        body = {"model": "tiny", "prompt": "ROMEO:", "max_tokens": 1500, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as answer:
            lines = answer.iter_lines()
            next(lines)  # the stream is running
            server.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
            with pytest.raises(httpx.TransportError):  # no new connections while draining
                httpx.get(f"{url}/health")
        assert rest[-1] == "data: [DONE]"
        usage = json.loads(rest[-2][6:])["usage"]
        last = json.loads(rest[-3][6:])["choices"][0]
        assert last["finish_reason"] == "length" and usage["completion_tokens"] == 1500
        assert server.wait(timeout=HANG_SECONDS) in (0, -signal.SIGTERM)
    finally:
        server.kill()
        server.wait()


@pytest.mark.slow
def test_sigterm_drains_eight_sampled_long_requests_to_their_natural_end(tmp_path):
    """The issue's reproduction: 8 concurrent sampled calls with max_tokens 3000 that end at
    <|endoftext|> after a few hundred tokens (a model whose <|endoftext|> has about 1/400 of
    the probability at every step), SIGTERM once all 8 run: every one is answered in full,
    with the text it gets undisturbed (seeded, float64), before serve.py exits."""
    import signal

    from helpers import save_checkpoint, start_serve_py, tiny

    from gptmini.checkpoint import load_checkpoint

    torch.manual_seed(0)
    model = GPTModel(tiny(context_length=64)).eval()
    with torch.no_grad():  # a near-constant last hidden state: <|endoftext|> at ~1/400
        model.final_norm.weight.fill_(0.1)
        model.final_norm.bias.fill_(1.0)
        model.out_head.weight[50256] = 0.22
    checkpoint = save_checkpoint(model, tmp_path / "ends.ckpt")
    reference, tokenizer, _ = load_checkpoint(checkpoint)
    engine = Engine(reference.double(), tokenizer)
    alone = [engine.add_request(tokenizer.encode(f"Request {i}:"), max_new_tokens=600,
                                temperature=0.7, seed=choice_seed(i, 0),
                                stop_ids=(tokenizer.eot_token,)) for i in range(24)]
    while engine.has_work:
        engine.step()
    # Seeds whose text ends on its own after 120 to 600 tokens: all 8 surely still run
    # when the signal comes, and none runs to max_tokens.
    seeds = [i for i, r in enumerate(alone) if r.finish_reason == "stop"
             and 120 <= len(r.tokens)][:8]
    assert len(seeds) == 8
    server, url = start_serve_py(checkpoint, "--dtype", "float64", "--drain", str(HANG_SECONDS))
    bodies = [{"prompt": f"Request {i}:", "max_tokens": 3000, "temperature": 0.7, "seed": i,
               "stream": k % 2 == 0} for k, i in enumerate(seeds)]

    def call(body):
        if not body["stream"]:
            return httpx.post(f"{url}/v1/completions", json=body, timeout=HANG_SECONDS).json()[
                "choices"][0]["text"]
        with httpx.stream("POST", f"{url}/v1/completions", json=body,
                          timeout=HANG_SECONDS) as answer:
            lines = [line for line in answer.iter_lines() if line]
        assert lines[-1] == "data: [DONE]", lines[-3:]
        return "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1])

    try:
        eventually(lambda: server.poll() is None and _healthy(url), HANG_SECONDS,
                   "serve.py did not start")
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(call, body) for body in bodies]
            eventually(lambda: httpx.get(f"{url}/health").json()["running"] == 8, HANG_SECONDS,
                       "the 8 requests did not all start")
            server.send_signal(signal.SIGTERM)
            texts = [f.result(timeout=HANG_SECONDS) for f in futures]
        assert server.wait(timeout=HANG_SECONDS) in (0, -signal.SIGTERM)
    finally:
        server.kill()
        log = server.communicate()[0]
    assert "Cancel" not in log, log
    assert texts == [alone[i].text for i in seeds]


@pytest.mark.slow
def test_sigterm_answers_every_sampled_request_past_the_context(tmp_path):
    """Issue 29 as reported: 8 concurrent sampled calls (no seed, max_tokens 3000, half of
    them streamed) whose 120-token prompts fill most of a context of 128, so that nearly
    every token is a recompute of the whole context, and that end at <|endoftext|> after
    about 170 tokens; SIGTERM 0.3 s after they are sent. With --drain 60 every call ends on its own
    (before: requests past the context took turns oldest first, so the youngest made no
    progress until the oldest ended and were dropped at the drain's end). With --drain 1,
    on a model that never ends them, every call is answered 503 (a stream: an error event
    instead of [DONE]) when the drain is over: no connection is dropped."""
    import signal

    from helpers import save_checkpoint, start_serve_py, tiny

    torch.manual_seed(0)
    endless_model = GPTModel(tiny(context_length=128)).eval()
    ending = GPTModel(tiny(context_length=128)).eval()
    with torch.no_grad():  # a near-constant last hidden state: <|endoftext|> at ~1/170
        ending.final_norm.weight.fill_(0.1)
        ending.final_norm.bias.fill_(1.0)
        ending.out_head.weight[50256] = 0.24
    servers = {}
    for name, model, drain in (("ends", ending, 60), ("endless", endless_model, 1)):
        checkpoint = save_checkpoint(model, tmp_path / f"{name}.ckpt")
        server, url = start_serve_py(checkpoint, "--drain", str(drain))
        servers[name] = (url, server)

    def call(url: str, stream: bool) -> tuple[int, str, int | None]:
        """(HTTP status, finish_reason or the error's message, completion tokens)"""
        body = {"prompt": [15496] * 120, "max_tokens": 3000, "temperature": 0.7, "stream": stream,
                "stream_options": {"include_usage": True} if stream else None}
        if not stream:
            answer = httpx.post(f"{url}/v1/completions", json=body, timeout=HANG_SECONDS)
            if answer.status_code != 200:
                return answer.status_code, answer.json()["error"]["message"], None
            found = answer.json()
            return 200, found["choices"][0]["finish_reason"], found["usage"]["completion_tokens"]
        with httpx.stream("POST", f"{url}/v1/completions", json=body,
                          timeout=HANG_SECONDS) as answer:
            lines = [line for line in answer.iter_lines() if line]
        if "error" in (last := json.loads(lines[-1][6:]) if lines[-1] != "data: [DONE]" else {}):
            return answer.status_code, last["error"]["message"], None  # (an error event)
        assert lines[-1] == "data: [DONE]", lines[-3:]
        reasons = [json.loads(line[6:])["choices"] for line in lines[:-2]]
        return (200, [c[0]["finish_reason"] for c in reasons if c][-1],
                json.loads(lines[-2][6:])["usage"]["completion_tokens"])

    try:
        for url, server in servers.values():
            eventually(lambda: server.poll() is not None or _healthy(url), HANG_SECONDS,  # noqa: B023
                       "serve.py did not start")
            assert server.poll() is None, server.communicate()[0]
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            futures = {name: [pool.submit(call, url, k % 2 == 0) for k in range(8)]
                       for name, (url, _) in servers.items()}
            for name, (url, _) in servers.items():  # all 8 started (a busy CPU may take a
                # while); one of the "ends" model's may already have ended on a fast CPU
                eventually(lambda: in_flight(url)  # noqa: B023
                           + sum(f.done() for f in futures[name]) == 8,  # noqa: B023
                           HANG_SECONDS, "the 8 calls did not all start")
            time.sleep(0.3)
            for _, server in servers.values():
                server.send_signal(signal.SIGTERM)
            answers = {name: [f.result(timeout=HANG_SECONDS) for f in fs]
                       for name, fs in futures.items()}
        for _, server in servers.values():
            assert server.wait(timeout=HANG_SECONDS) in (0, -signal.SIGTERM)
    finally:
        logs = {}
        for name, (_, server) in servers.items():
            server.kill()
            logs[name] = server.communicate()[0]
    assert all("Cancel" not in log for log in logs.values()), logs
    assert all(status == 200 and reason == "stop" for status, reason, _ in answers["ends"]), answers
    assert sum(tokens > 8 for _, _, tokens in answers["ends"]) >= 4, answers  # slid
    assert [status for status, _, _ in answers["endless"]] == [200, 503] * 4  # (events)
    assert all("shutting down" in message and "--drain" in message
               for _, message, _ in answers["endless"]), answers


def in_flight(url: str) -> int:
    health = httpx.get(f"{url}/health").json()
    return health["running"] + health["waiting"]


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health").status_code == 200
    except httpx.TransportError:
        return False


def test_serve_py_names_a_bad_checkpoint_or_a_busy_port(tmp_path, capsys):
    import socket

    from gptmini.serve.command import serve_main

    with pytest.raises(SystemExit) as missing:
        serve_main(["--checkpoint", str(tmp_path / "none.ckpt"), "--port", "0"])
    assert missing.value.code == 2 and "no checkpoint at" in capsys.readouterr().err
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = str(busy.getsockname()[1])
        with pytest.raises(SystemExit) as taken:
            serve_main(["--checkpoint", str(tmp_path / "none.ckpt"), "--port", port])
    assert taken.value.code == 2 and f"cannot listen on 127.0.0.1:{port}" in (
        capsys.readouterr().err)
