"""The page in a real browser: headless Chromium (Debian's) driven by Playwright against a
live server on a free loopback port. Every test fails on any JavaScript error or console
error. Skipped, with the reason, where Chromium or Playwright is missing (.ci/run installs
both)."""

import base64
import os
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
playwright_api = pytest.importorskip("playwright.sync_api",
                                     reason="Playwright is missing: pip install playwright")

import test_page  # noqa: E402
from helpers import start_serve_py  # noqa: E402
from test_page import ENC, KEY, WINDOW  # noqa: E402

run, served = test_page.run, test_page.served  # the page's fixtures: a run and its server

CHROMIUM = os.environ.get("GPTMINI_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
if not Path(CHROMIUM).is_file():
    pytest.skip(f"no Chromium at {CHROMIUM}: apt-get install chromium (or set "
                "GPTMINI_CHROMIUM)", allow_module_level=True)
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    with playwright_api.sync_playwright() as driver:
        context = driver.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=CHROMIUM,
            headless=True, args=ARGS, viewport={"width": 1400, "height": 1000})
        yield context
        context.close()


@pytest.fixture
def page(browser):
    """A fresh tab; at the end, no JavaScript error and no console error may have happened
    (but the browser's own network log, "Failed to load resource", which an expected 400
    or a killed server writes)."""
    tab = browser.new_page()
    errors = []
    tab.on("pageerror", lambda err: errors.append(f"uncaught: {err}"))
    tab.on("console", lambda m: m.type == "error" and errors.append(f"console: {m.text}"))
    tab.errors = errors
    yield tab
    tab.close()
    assert not [e for e in errors if "Failed to load resource" not in e], errors


def open_page(page, url: str):
    page.goto(f"{url}/")
    page.fill("#api_key", "k")
    page.dispatch_event("#api_key", "change")
    page.wait_for_selector("#roles td.role")


def weights_of(url: str, ids: list[int]) -> np.ndarray:
    data = httpx.post(f"{url}/gptmini/attention", json={"prompt": ids}, headers=KEY,
                      timeout=30).json()
    n = data["num_tokens"]
    flat = np.frombuffer(base64.b64decode(data["weights"]["data"]), "<f2").astype(np.float32)
    out = np.zeros((data["n_layers"], data["n_heads"], n, n), np.float32)
    rows, cols = np.tril_indices(n)
    out[:, :, rows, cols] = flat.reshape(data["n_layers"], data["n_heads"], -1)
    return out, data


def test_stream_hover_candidates_layers_heads_and_roles(served, page, tmp_path):
    url, _ = served
    open_page(page, url)
    assert "training steps" in page.inner_text("#checkpoint")
    assert page.locator("#curves polyline.curve").count() == 2  # train and val loss
    page.fill("#prompt", "ROMEO. But soft")
    page.fill("#temperature", "0")
    page.fill("#max_tokens", "12")
    page.click("#generate")
    page.wait_for_selector("body[data-state=done]")
    answer = httpx.post(f"{url}/v1/completions", headers=KEY, json={
        "prompt": "ROMEO. But soft", "max_tokens": 12, "temperature": 0,
        "return_token_ids": True}).json()["choices"][0]
    ids = ENC.encode("ROMEO. But soft") + answer["token_ids"]
    page.wait_for_selector(f"body[data-attention-tokens='{len(ids)}']")
    chips = page.locator("#tokens .chip")
    assert chips.count() == len(ids)
    assert page.locator("#tokens .chip.generated").count() == len(answer["token_ids"])
    weights, data = weights_of(url, ids)

    query = len(ids) - 2
    chips.nth(query).hover()
    shown = [float(x or 0) for x in page.eval_on_selector_all(
        "#tokens .chip", "cs => cs.map(c => c.dataset.weight)")]
    assert np.allclose(shown[: query + 1], weights[0].mean(0)[query, : query + 1], atol=2e-3)
    masked = page.eval_on_selector_all("#tokens .chip",
                                       "cs => cs.map(c => c.classList.contains('masked'))")
    assert masked == [j <= query - WINDOW or j > query for j in range(len(ids))]
    logprobs = [float(x) for x in page.eval_on_selector_all(
        "#candidates tr.candidate", "rs => rs.map(r => r.dataset.logprob)")]
    assert logprobs == pytest.approx([v for _, _, v in data["top_logprobs"][query]], abs=1e-6)
    assert page.locator("#candidates tr.actual").count() == 1  # the token that came next

    page.select_option("#layer", "1")
    page.select_option("#head", "1")
    shown = [float(x or 0) for x in page.eval_on_selector_all(
        "#tokens .chip", "cs => cs.map(c => c.dataset.weight)")]
    assert np.allclose(shown[: query + 1], weights[1, 1, query, : query + 1], atol=2e-3)
    assert page.locator("#grid .head").count() == 2
    assert page.get_attribute("#grid .head.current", "data-head") == "1"

    page.click("#roles td.role[data-layer='0'][data-head='0']")
    assert page.input_value("#layer") == "0" and page.input_value("#head") == "0"
    assert page.get_attribute("#grid .head.current", "data-head") == "0"
    page.click("#grid .head[data-head='1']")
    assert page.input_value("#head") == "1"
    page.screenshot(path=str(tmp_path / "page.png"), full_page=True)
    assert (tmp_path / "page.png").stat().st_size > 10_000


def test_bad_inputs_show_a_message(served, page):
    url, _ = served
    open_page(page, url)
    page.fill("#prompt", "   ")
    page.click("#generate")
    assert "prompt is empty" in page.inner_text("#message")
    page.fill("#prompt", "x" * 60)  # context_length 48
    page.click("#generate")
    page.wait_for_selector("body[data-state=error]")
    assert "context_length is 48" in page.inner_text("#message")
    assert page.is_visible("#message")
    page.click("#inspect")  # the same prompt, attention alone: the endpoint's limit is 40
    page.wait_for_function("document.querySelector('#message').textContent.includes('40')")
    page.fill("#prompt", "To be, or not")
    page.click("#inspect")
    page.wait_for_selector("body[data-attention-tokens='13']")
    assert page.locator("#tokens .chip").count() == 13 and page.is_hidden("#message")
    assert page.locator("#candidates tr.candidate").count() == 10  # after the last token


@pytest.fixture(scope="module")
def endless(tmp_path_factory):
    """A checkpoint whose model never draws <|endoftext|>: the same distribution at every
    position (a constant last hidden state), with <|endoftext|>'s logit far below."""
    import torch
    from helpers import save_checkpoint

    from gptmini.model import GPTConfig, GPTModel

    torch.manual_seed(0)
    model = GPTModel(GPTConfig(vocab_size=ENC.n_vocab, context_length=48, emb_dim=32,
                               n_heads=2, n_layers=2, drop_rate=0.0)).eval()
    with torch.no_grad():
        model.final_norm.weight.zero_()
        model.final_norm.bias.normal_()
        model.out_head.weight[ENC.eot_token] = -model.final_norm.bias  # logit -|bias|^2
    return save_checkpoint(model, tmp_path_factory.mktemp("endless") / "endless.ckpt", "byte")


def test_a_server_that_stops_mid_stream_leaves_a_message(endless, page):
    server, url = start_serve_py(endless, "--dtype", "float32",
                                 env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 60
        while True:
            assert server.poll() is None and time.monotonic() < deadline, "serve.py did not start"
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        page.goto(f"{url}/")
        page.wait_for_selector("#roles td.role")
        page.fill("#max_tokens", "100000")
        page.click("#generate")
        page.wait_for_selector("#tokens .chip.generated")
        assert page.get_attribute("body", "data-state") == "streaming"
        server.send_signal(signal.SIGKILL)
        page.wait_for_selector("body[data-state=error]", timeout=15_000)
        assert "stopped mid-stream" in page.inner_text("#message")
        assert page.locator("#tokens .chip.generated").count() > 0  # what came stays
    finally:
        server.kill()
        server.wait()
