"""Does a 256-token text's full attention reach the page and draw in under a second?

The default run's model shape (gptmini/configs/shakespeare-cpu.yaml: 4 layers, 4 heads,
emb 256, tied, a 4,096-id BPE fitted here to Hamlet) with context_length 256 instead of
128 (a 256-token text needs it), random weights, float32, served by `create_app` in its
own process as serve.py would. Measured, medians of --repeats:

1. POST /gptmini/attention from Python, per weights encoding (float16, the page's; uint8;
   json, lists of numbers): the answer's size, the time to the parsed answer, and to the
   weights as an array;
2. in headless Chromium (when Playwright and Debian's chromium are there): the page's
   "Inspect prompt", from the click's fetch to the chips, the candidates and every head's
   grid drawn (the page's own `performance.now()` timings).

    python bench/bench_inspection.py [--repeats 7]
"""

import argparse
import base64
import gzip
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import torch
from local_server import start_server
from machine import cpu_description

from gptmini.generate.engine import Engine
from gptmini.model import GPTConfig, GPTModel, init_gpt2_weights
from gptmini.tokenizer import ASSETS, get_tokenizer, save_tokenizer, train_bpe

TOKENS = 256
SHAPE = dict(context_length=TOKENS, emb_dim=256, n_heads=4, n_layers=4, drop_rate=0.0,
             tie_weights=True)


def serve(port: int, tokenizer_path: str) -> None:
    """The server process."""
    import uvicorn

    from gptmini.serve.app import create_app

    tokenizer = get_tokenizer(tokenizer_path)
    torch.manual_seed(0)
    model = init_gpt2_weights(GPTModel(GPTConfig(vocab_size=tokenizer.n_vocab, **SHAPE))).eval()
    app = create_app(Engine(model, tokenizer, max_batch=4), "bench")
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error")


def text_of(tokenizer, count: int) -> str:
    """A piece of Hamlet that encodes to exactly `count` tokens."""
    words = gzip.open(ASSETS / "shakespeare" / "hamlet_gut.txt.gz", "rt").read()[20_000:]
    ids = tokenizer.encode(words)[:count]
    text = tokenizer.decode(ids)
    while len(tokenizer.encode(text)) > count:
        text = text[:-1]
    return text


def weights_array(data: dict) -> np.ndarray:
    w = data["weights"]
    if w["encoding"] == "json":
        return np.asarray(w["data"], np.float32)
    raw = base64.b64decode(w["data"])
    return (np.frombuffer(raw, "<f2").astype(np.float32) if w["encoding"] == "float16"
            else np.frombuffer(raw, np.uint8) / np.float32(255))


def in_browser(url: str, text: str, repeats: int) -> list[dict] | str:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return "not measured: no Playwright (pip install playwright)"
    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(chromium).is_file():
        return "not measured: no chromium (apt-get install chromium)"
    timings = []
    with sync_playwright() as driver, tempfile.TemporaryDirectory() as profile:
        context = driver.chromium.launch_persistent_context(
            profile, executable_path=chromium, headless=True,
            args=["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"],
            viewport={"width": 1400, "height": 1000})
        page = context.new_page()
        page.goto(f"{url}/")
        page.wait_for_selector("#roles td.role")
        page.fill("#prompt", text)
        for _ in range(repeats + 1):  # the first warms up
            page.evaluate("delete document.body.dataset.attentionTokens")
            page.click("#inspect")
            page.wait_for_selector(f"body[data-attention-tokens='{TOKENS}']")
            timings.append(page.evaluate("window.gptmini.timings"))
        context.close()
    return timings[1:]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(f"CPU: {cpu_description()}; {os.cpu_count()} cores; torch {torch.__version__}; "
          f"{TOKENS} tokens, 4 layers x 4 heads\n")
    hamlet = gzip.open(ASSETS / "shakespeare" / "hamlet_gut.txt.gz", "rt").read()
    tokenizer = train_bpe([hamlet], 4096)
    workdir = tempfile.mkdtemp()
    path = str(save_tokenizer(tokenizer, Path(workdir) / "bpe4096.json"))
    text = text_of(tokenizer, TOKENS)
    assert len(tokenizer.encode(text)) == TOKENS

    process, url = start_server(serve, path)

    results = {}
    try:
        for encoding in ("float16", "uint8", "json"):
            body = {"prompt": text, "top_logprobs": 10, "encoding": encoding}
            httpx.post(f"{url}/gptmini/attention", json=body, timeout=60)  # warm-up
            parsed, arrays = [], []
            for _ in range(args.repeats):
                start = time.perf_counter()
                answer = httpx.post(f"{url}/gptmini/attention", json=body, timeout=60)
                data = answer.json()
                parsed.append(time.perf_counter() - start)
                weights_array(data)
                arrays.append(time.perf_counter() - start)
            results[encoding] = {"bytes": len(answer.content),
                                 "weights_bytes": len(json.dumps(data["weights"],
                                                                 separators=(",", ":"))),
                                 "parsed_ms": 1e3 * statistics.median(parsed),
                                 "array_ms": 1e3 * statistics.median(arrays)}
            r = results[encoding]
            print(f"{encoding:8s} answer {r['bytes'] / 1e6:6.2f} MB (weights "
                  f"{r['weights_bytes'] / 1e6:5.2f} MB); parsed in {r['parsed_ms']:6.1f} ms, "
                  f"weights as an array in {r['array_ms']:6.1f} ms")
        page = in_browser(url, text, args.repeats)
    finally:
        process.terminate()
        process.join(timeout=30)
    if isinstance(page, str):
        print(f"page     {page}")
    else:
        medians = {k: statistics.median(t[k] for t in page)
                   for k in ("fetchMs", "decodeMs", "drawMs", "totalMs")}
        print(f"page     fetch {medians['fetchMs']:.0f} ms, decode {medians['decodeMs']:.0f} ms, "
              f"draw {medians['drawMs']:.0f} ms: {medians['totalMs']:.0f} ms from the click "
              f"to everything drawn (goal < 1000 ms; worst of {len(page)}: "
              f"{max(t['totalMs'] for t in page):.0f} ms)")
        results["page"] = medians
    print(json.dumps(results))


if __name__ == "__main__":
    main()
