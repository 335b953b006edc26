"""serve.py: flags with wrong numbers, and one shared server called over HTTP with wrong
JSON types, sizes and headers, a binary body and a client hanging up mid-body."""

import json
import socket
import subprocess
import sys
import time

from robustness_cases.lab import Lab, last_line, outcome, trained

TINY_CHECKPOINT = (
    "import sys, torch\nfrom gptmini.model import GPTConfig, GPTModel\n"
    "torch.manual_seed(0)\n"
    "m = GPTModel(GPTConfig(vocab_size=50257, context_length=32, emb_dim=16, "
    "n_heads=2, n_layers=2, drop_rate=0.0))\n"
    "torch.save({'state_dict': {'model.' + k: v for k, v in m.state_dict().items()},"
    " 'hyper_parameters': {**m.cfg.to_dict(), 'tokenizer': 'gpt2'}}, sys.argv[1])\n")
"""Python writing a random tiny model's checkpoint to sys.argv[1], without training."""


class Server:
    """One serve.py on a tiny checkpoint, shared by the server cases (`Server.of(lab)`), or
    on a checkpoint of a case's own (`checkpoint`: Python writing it to sys.argv[1]; it is
    saved as `runs/r/checkpoints/tiny.ckpt` under a folder `prepare(folder)` may add to)."""

    def __init__(self, lab: Lab, checkpoint: str = TINY_CHECKPOINT, prepare=None):
        where = lab.folder()
        if prepare is not None:
            (where / "checkpoints").mkdir()
            prepare(where)
            where = where / "checkpoints"
        lab.python(checkpoint, str(where / "tiny.ckpt"), cwd=where)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.log, self.url = where / "log", f"http://127.0.0.1:{port}"
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(
                [sys.executable, str(lab.tree / "serve.py"), "--checkpoint",
                 str(where / "tiny.ckpt"), "--port", str(port), "--api_key", "k",
                 "--max_pending", "64", "--dtype", "float32", "--timeout", "5"],
                cwd=where, env=lab.env, stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                post(self.url + "/health", None, method="GET")
                return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError("serve.py did not start")

    @staticmethod
    def of(lab: Lab) -> "Server":
        return lab.shared("server", Server)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)


def post(url: str, body, headers=None, method="POST", raw: bytes | None = None):
    """(status, parsed JSON answer) of one HTTP call, with the standard library."""
    import urllib.error
    import urllib.request

    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={
        "content-type": "application/json", "authorization": "Bearer k", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def server_case(body, expected_status: int, param: str | None = None, headers=None):
    """One call to the shared server: the status wanted, and a 400's param named."""

    def case(lab: Lab):
        server = Server.of(lab)
        before = server.log.read_text()
        status, text = post(server.url + "/v1/completions", body, headers)
        logged = server.log.read_text()[len(before):]
        if (status >= 500 and status != expected_status) or "Traceback" in logged:
            return "traceback", f"{status}: {text[:100]}"
        if status != expected_status:
            return "silent", f"{status}, wanted {expected_status}: {text[:100]}"
        if param is not None and json.loads(text)["error"]["param"] != param:
            return "silent", f"{status}, but the error names {json.loads(text)['error']['param']}"
        return ("clear error" if 400 <= status < 500 else "ok"), f"{status} {text[:90]}"

    return case


def server_hangup(lab: Lab):
    server = Server.of(lab)
    before = server.log.read_text()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer k\r\n"
                     b"content-length: 500\r\n\r\n{\"prompt")
        time.sleep(0.3)
    time.sleep(0.5)
    logged = server.log.read_text()[len(before):]
    return ("traceback" if "Traceback" in logged else "ok"), f"{len(logged)} bytes logged"


def serve_flag(*flags: str):
    def case(lab: Lab):
        where = lab.folder()
        proc = lab.run("serve.py", "--checkpoint", str(trained(lab, where)), "--port", "0",
                       *flags, cwd=where, timeout=60)
        return ("silent" if outcome(proc) == "ok" else outcome(proc)), last_line(proc)

    return case


def binary_body(lab: Lab):
    status, text = post(Server.of(lab).url + "/v1/completions", None,
                        raw=b"\x89PNG\x00\xff\xfe")
    if status >= 500:
        return "traceback", f"{status}"
    return ("clear error" if status == 400 else "silent"), f"{status} {text[:90]}"


def page_case(path: str, wanted: int, said: str, checkpoint: str = TINY_CHECKPOINT,
              prepare=None, body=None):
    """A serve.py of its own (the checkpoint, a run folder `prepare` fills), one call to a
    page endpoint: the status wanted, saying `said`; a 500 that says nothing is a traceback."""

    def case(lab: Lab):
        try:
            server = Server(lab, checkpoint, prepare)
        except RuntimeError:
            return "traceback", "serve.py did not start"
        try:
            status, text = post(server.url + path, body, method="GET" if body is None
                                else "POST")
            logged = server.log.read_text()
        finally:
            server.stop()
        if "Traceback" in logged or (status >= 500 and said not in text):
            return "traceback", f"{status}: {text[:100]}"
        if status != wanted or said not in text:
            return "silent", f"{status}, wanted {wanted} saying {said!r}: {text[:90]}"
        return ("ok" if status == 200 else "clear error"), f"{status} {text[:90]}"

    return case


def metrics(rows: str):
    def prepare(where):
        (where / "logs" / "version_0").mkdir(parents=True)
        (where / "logs" / "version_0" / "metrics.csv").write_text(
            "epoch,step,train/loss,val/loss\n" + rows)

    return prepare


NAN_MODEL = TINY_CHECKPOINT.replace(
    "torch.save(", "m.trf_blocks[0].att.W_query.weight.data[0, 0] = 1e38\n"
    "m.trf_blocks[0].att.W_key.weight.data[0, 0] = 1e38\ntorch.save(")
"""Finite weights whose attention scores overflow float32 (NaN weights are refused at load)."""
SHORT_CONTEXT = TINY_CHECKPOINT.replace("context_length=32", "context_length=4")

PAGE = {
    "page: /gptmini/checkpoint with a NaN loss logged": page_case(
        "/gptmini/checkpoint", 200, "non_finite_steps", prepare=metrics("0,1,5.0,\n0,2,nan,nan\n")),
    "page: serve.py on a run whose metrics hold a 200 KB cell": page_case(
        "/gptmini/checkpoint", 200, "train/loss",
        prepare=metrics("0,1,5.0,\n0,2,\"" + "9" * 200_000 + "\",\n")),
    "page: a metrics file cut mid-row": page_case(
        "/gptmini/checkpoint", 200, "train/loss", prepare=metrics("0,1,5.0,\n0,2,4.")),
    "page: /gptmini/heads, context_length 4": page_case("/gptmini/heads", 422,
                                                       "context_length is 4",
                                                       checkpoint=SHORT_CONTEXT),
    "page: /gptmini/attention, scores overflowing": page_case(
        "/gptmini/attention", 500, "not finite", checkpoint=NAN_MODEL, body={"prompt": "ab"}),
    "page: /gptmini/attention, top_logprobs 1e9": page_case(
        "/gptmini/attention", 400, "top_logprobs", body={"prompt": "ab", "top_logprobs": 10**9}),
}


def seeded_batch_invariance(lab: Lab):
    """A seeded float32 call: the docs say a batched draw may flip; the answer must say so."""
    status, text = post(Server.of(lab).url + "/v1/completions",
                        {"prompt": "a", "max_tokens": 2, "seed": 1})
    if status != 200:
        return "traceback" if status >= 500 else "clear error", f"{status} {text[:90]}"
    said = json.loads(text).get("batch_invariant")
    return ("ok" if said is False else "silent"), f"batch_invariant {said!r} (float32)"


CASES = {
    **PAGE,
    "server: a seeded float32 call says it is not batch-invariant": seeded_batch_invariance,
    "server: stream as the string false": server_case({"prompt": "a", "stream": "false"}, 400,
                                                      "stream"),
    "server: temperature true": server_case({"prompt": "a", "temperature": True}, 400,
                                            "temperature"),
    "server: max_tokens as a string": server_case({"prompt": "a", "max_tokens": "5"}, 400,
                                                  "max_tokens"),
    "server: max_tokens huge, bounded by --timeout": server_case(
        {"prompt": "a", "max_tokens": 10**30}, 504),
    "server: n 0.5": server_case({"prompt": "a", "n": 0.5}, 400, "n"),
    "server: top_k negative": server_case({"prompt": "a", "top_k": -3}, 400, "top_k"),
    "server: top_p NaN-like string": server_case({"prompt": "a", "top_p": "nan"}, 400, "top_p"),
    "server: seed 2**70": server_case({"prompt": "a", "seed": 2**70}, 400, "seed"),
    "server: stream_options a list": server_case(
        {"prompt": "a", "stream": True, "stream_options": ["include_usage"]}, 400,
        "stream_options"),
    "server: stop 5": server_case({"prompt": "a", "stop": 5}, 400, "stop"),
    "server: prompt of token ids out of range": server_case({"prompt": [10**9]}, 400, "prompt"),
    "server: echo 0": server_case({"prompt": "a", "echo": 0}, 400, "echo"),
    "server: a body that is binary": binary_body,
    "server: prompts x n over --max_pending": server_case(
        {"prompt": ["a"] * 8, "n": 9, "max_tokens": 1}, 400, "prompt"),
    "server: Authorization bearer in lower case": server_case(
        {"prompt": "a", "max_tokens": 1}, 200, headers={"authorization": "bearer k"}),
    "server: a client hanging up mid-body": server_hangup,
    "serve.py --block_size 0": serve_flag("--block_size", "0"),
    "serve.py --max_batch 0": serve_flag("--max_batch", "0"),
    "serve.py --num_blocks -1": serve_flag("--num_blocks", "-1"),
    "serve.py --timeout nan": serve_flag("--timeout", "nan"),
    "serve.py --max_pending 0": serve_flag("--max_pending", "0"),
}
