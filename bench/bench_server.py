"""The server's cost: N concurrent clients over loopback against the engine offline.

A server on 127.0.0.1 serves the small CPU model (random weights, float32); N client
threads send the same seeded workload as bench_serving.py (prompts and outputs uniform in
8..64 tokens, greedy, no stop token), each request timed from send to last byte, and, with
streaming, to its first token. Printed: generated tokens/s, p50/p99 latency, p50/p99 time
to first token, failed requests; beside it the engine offline on the same requests.

    python bench/bench_server.py [--clients 16] [--requests 64]
"""

import argparse
import concurrent.futures
import json
import os
import random
import statistics
import threading
import time

import httpx
import torch
import uvicorn
from machine import cpu_description

from gptmini.engine import Engine
from gptmini.model import GPTConfig, GPTModel
from gptmini.server import create_app
from gptmini.tokenizer import get_tokenizer


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max_batch", type=int, default=64)
    args = parser.parse_args()
    print(f"CPU: {cpu_description()}; {os.cpu_count()} cores; torch {torch.__version__}; "
          f"{args.clients} clients, {args.requests} requests\n")
    torch.manual_seed(0)
    enc = get_tokenizer("gpt2")
    model = GPTModel(GPTConfig.from_preset("cpu-small", drop_rate=0.0)).eval()
    rng = random.Random(0)
    work = [([rng.randrange(enc.eot_token) for _ in range(rng.randint(8, 64))],
             rng.randint(8, 64)) for _ in range(args.requests)]

    offline = Engine(model, enc, max_batch=args.max_batch)
    start = time.perf_counter()
    done = offline.generate([p for p, _ in work][:1], max_new_tokens=2)  # warm-up
    start = time.perf_counter()
    requests = [offline.add_request(prompt, max_new_tokens=new, stop_ids=(enc.eot_token,))
                for prompt, new in work]  # what the server does: stop at <|endoftext|>
    while offline.has_work:
        offline.step()
    offline_rate = sum(len(r.tokens) for r in requests) / (time.perf_counter() - start)
    del done

    engine = Engine(model, enc, max_batch=args.max_batch)
    server = uvicorn.Server(uvicorn.Config(create_app(engine, "bench"), host="127.0.0.1",
                                           port=0, log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}/v1/completions"

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

    start = time.perf_counter()
    failed, results = 0, []
    with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
        for future in [pool.submit(call, w) for w in work]:
            try:
                results.append(future.result())
            except Exception:
                failed += 1
    took = time.perf_counter() - start
    server.should_exit = True
    latency, ttft = [r[0] for r in results], [r[1] for r in results]
    served = sum(r[2] for r in results) / took
    print(f"engine offline        {offline_rate:8.1f} tok/s")
    print(f"server, streamed      {served:8.1f} tok/s ({served / offline_rate:.0%} of offline); "
          f"latency p50 {statistics.median(latency):.2f} s, p99 {percentile(latency, 0.99):.2f}"
          f" s; first token p50 {statistics.median(ttft) * 1e3:.0f} ms, p99 "
          f"{percentile(ttft, 0.99) * 1e3:.0f} ms; {failed} failed of {len(work)}")
    print(json.dumps({"offline": offline_rate, "served": served, "failed": failed}))


if __name__ == "__main__":
    main()
