"""The server's cost: N concurrent clients over loopback against the engine offline.

The server runs in its own process, as `serve.py` would, with the small CPU model (random
weights, float32). N client threads send bench_serving.py's seeded workload (prompts and
outputs uniform in 8..64 tokens, greedy, ending early at <|endoftext|> as the server
does), streamed, each request timed from send to its last event and to its first token.
Printed: generated tokens/s, p50/p99 latency and time to first token, failed requests;
beside them the engine offline on the same requests with the same number in flight (the
server's overhead). The clients' process takes about one core, as a remote client would
not, so both the server and the offline engine get the other cores' worth of torch threads
(`--threads`, default cores - 1): the ratio is then the server's own cost (HTTP, the event
loop, streaming), not the core the clients took from it.

    python bench/bench_server.py [--clients 16] [--requests 64] [--threads N]
"""

import argparse
import concurrent.futures
import json
import os
import statistics
import time

from gptmini.threads import sleep_when_idle

sleep_when_idle()  # as serve.py does, before torch loads OpenMP (the server process too)

import httpx  # noqa: E402
import torch  # noqa: E402
from bench_serving import SHAPES, workload  # noqa: E402
from local_server import start_server  # noqa: E402
from machine import cpu_description  # noqa: E402

from gptmini.generate.engine import Engine  # noqa: E402
from gptmini.model import GPTModel, init_gpt2_weights  # noqa: E402
from gptmini.tokenizer import get_tokenizer  # noqa: E402


def build(max_batch: int) -> Engine:
    torch.manual_seed(0)
    model = init_gpt2_weights(GPTModel(SHAPES["small"][0])).eval()
    return Engine(model, get_tokenizer("gpt2"), max_batch=max_batch)


def serve(port: int, max_batch: int, threads: int) -> None:
    """The server process: the same engine behind uvicorn on a loopback port."""
    import uvicorn

    torch.set_num_threads(threads)
    from gptmini.serve.app import create_app

    uvicorn.run(create_app(build(max_batch), "bench"), host="127.0.0.1", port=port,
                log_level="error")


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                        help="torch threads of the server and of the offline engine alike")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_description()}; {os.cpu_count()} cores; torch {torch.__version__}; "
          f"{args.clients} clients, {args.requests} requests; torch threads {args.threads} (server "
          f"and offline); OMP_WAIT_POLICY="
          f"{os.environ.get('OMP_WAIT_POLICY', 'default')}\n")
    eot = get_tokenizer("gpt2").eot_token
    cfg, prompts, outputs = SHAPES["small"]
    work = workload(cfg, prompts, outputs, args.requests)

    offline = build(max_batch=args.clients)  # as many in flight as the server will have
    offline.generate([work[0][0]], max_new_tokens=2)  # warm-up
    start = time.perf_counter()
    requests = [offline.add_request(prompt, max_new_tokens=new, stop_ids=(eot,))
                for prompt, new in work]  # what the server does: stop at <|endoftext|>
    while offline.has_work:
        offline.step()
    offline_rate = sum(len(r.tokens) for r in requests) / (time.perf_counter() - start)
    del offline, requests

    process, url = start_server(serve, 64, args.threads)
    url += "/v1/completions"

    def call(item):
        prompt, new = item
        body = {"model": "bench", "prompt": prompt, "max_tokens": new, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}
        sent, first, tokens = time.perf_counter(), None, 0
        with httpx.stream("POST", url, json=body, timeout=300) as answer:
            answer.raise_for_status()
            for line in answer.iter_lines():
                if not line.startswith("data: {"):
                    continue
                payload = json.loads(line[6:])
                if first is None and payload["choices"] and payload["choices"][0]["text"]:
                    first = time.perf_counter()
                if payload.get("usage"):
                    tokens = payload["usage"]["completion_tokens"]
        return time.perf_counter() - sent, (first or time.perf_counter()) - sent, tokens

    call(work[0])  # warm-up
    start = time.perf_counter()
    failed, results = 0, []
    with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
        for future in [pool.submit(call, w) for w in work]:
            try:
                results.append(future.result())
            except Exception:
                failed += 1
    took = time.perf_counter() - start
    process.terminate()
    process.join(timeout=30)
    latency, ttft = [r[0] for r in results], [r[1] for r in results]
    served = sum(r[2] for r in results) / took
    print(f"engine offline        {offline_rate:8.1f} tok/s ({args.clients} in flight)")
    print(f"server, streamed      {served:8.1f} tok/s ({served / offline_rate:.0%} of offline); "
          f"latency p50 {statistics.median(latency):.2f} s, p99 {percentile(latency, 0.99):.2f}"
          f" s; first token p50 {statistics.median(ttft) * 1e3:.0f} ms, p99 "
          f"{percentile(ttft, 0.99) * 1e3:.0f} ms; {failed} failed of {len(work)}")
    print(json.dumps({"offline": offline_rate, "served": served, "failed": failed}))


if __name__ == "__main__":
    main()
