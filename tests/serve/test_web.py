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
from helpers import HANG_SECONDS, start_serve_py  # noqa: E402
from test_page import ENC, KEY, WINDOW, by_hand_first_layer  # noqa: E402

from gptmini.serve.page import parameter_parts  # noqa: E402

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
        context.set_default_timeout(HANG_SECONDS * 1000)  # Playwright's 30 s: a busy machine's
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


def inspect(page, url: str, text: str) -> list[int]:
    """Open the page and inspect `text` (no generation): its token ids."""
    open_page(page, url)
    page.fill("#prompt", text)
    page.click("#inspect")
    ids = ENC.encode(text)
    page.wait_for_selector(f"body[data-attention-tokens='{len(ids)}']")
    return ids


def drawn_lines(page) -> dict[tuple[int, int, int], float]:
    """The head view's lines: (head, query, key) -> stroke opacity."""
    rows = page.eval_on_selector_all("#headview line", "ls => ls.map(l => [l.dataset.head, "
                                     "l.dataset.query, l.dataset.key, "
                                     "l.getAttribute('stroke-opacity')])")
    return {(int(h), int(i), int(j)): float(w) for h, i, j, w in rows}


def on_lines(page) -> set[tuple[int, int, int]]:
    """The lines kept while a token is hovered: (head, query, key)."""
    return set(map(tuple, page.eval_on_selector_all(
        "#headview line.on", "ls => ls.map(l => [+l.dataset.head, +l.dataset.query, "
        "+l.dataset.key])")))


def marked(page, selector: str) -> list[int]:
    return sorted(page.eval_on_selector_all(selector, "gs => gs.map(g => +g.dataset.index)"))


def test_head_view_lines_follow_the_weights_per_head_both_ways(served, page):
    url, model = served
    ids = inspect(page, url, "To be, or not")
    assert page.inner_text("#status") == "the prompt's 13 tokens inspected"
    page.click("#tabs button[data-view=headview]")
    assert page.is_hidden("#grid") and page.is_visible("#headview svg.hv")
    by_hand = by_hand_first_layer(model, ids).numpy()  # (n_heads, num_tokens, num_tokens)
    expected = {(h, i, j): by_hand[h, i, j] for h, i, j in zip(*np.nonzero(by_hand >= 0.01),
                                                                strict=True)}
    lines = drawn_lines(page)
    assert lines.keys() == expected.keys()  # one line per head and open pair, the window's
    assert len(lines) == 2 * sum(min(i + 1, WINDOW) for i in range(len(ids)))
    assert np.allclose([lines[k] for k in expected], list(expected.values()), atol=2e-3)

    page.click(".hv-head[data-head='1']")  # head 1 off: only head 0's lines stay
    assert drawn_lines(page).keys() == {k for k in expected if k[0] == 0}
    assert "off" in page.get_attribute(".hv-head[data-head='1']", "class")
    page.click(".hv-head[data-head='1']")
    assert drawn_lines(page).keys() == expected.keys()

    key = 5  # hovering a key: the queries that attend to it, query 5 to 5 + WINDOW - 1
    page.hover(f"#headview g.token.key[data-index='{key}']")
    queries = list(range(key, key + WINDOW))
    assert on_lines(page) == {(h, i, key) for h in (0, 1) for i in queries}
    assert marked(page, "#headview g.token.query.linked") == queries
    hidden = page.eval_on_selector("#headview line:not(.on)", "l => getComputedStyle(l).display")
    assert hidden == "none"
    query = 8  # hovering a query: the keys it attends to
    page.hover(f"#headview g.token.query[data-index='{query}']")
    assert on_lines(page) == {(h, query, j) for h in (0, 1) for j in range(3, 9)}
    assert marked(page, "#headview g.token.key.linked") == list(range(3, 9))

    page.select_option(".hv-layer", "1")  # the head view's layer is the page's
    assert page.input_value("#layer") == "1"
    weights, _ = weights_of(url, ids)
    lines = drawn_lines(page)
    assert np.allclose([w for w in lines.values()], [weights[1][k] for k in lines], atol=2e-3)


def test_model_view_legend_and_the_small_flaws(served, page):
    url, model = served
    ids = inspect(page, url, "To be, or not")
    info = page.inner_text("#checkpoint")
    parts = [f"{n:,}" for n in parameter_parts(model).values() if n]
    assert all(p in info for p in parts) and "output head (untied)" in info
    tied = page.evaluate("async () => (await import('/web/panels.js')).parametersText("
                         "{parameters: 7520, tied_weights: true, parameter_parts: {blocks: "
                         "6496, token_embedding: 1024, position_embedding: 0, output_head: 0}})")
    assert tied == ("7,520: 6,496 in the blocks and final norm, 1,024 in the token embedding "
                    "(tied: it is also the output head)")
    assert page.locator("#curves text.tick.step").count() == 3  # the axes: steps and losses
    assert page.locator("#curves text.tick.loss").count() == 3
    assert page.locator("#curves text.axis-label").all_text_contents() == ["step", "loss"]

    assert page.is_visible("#legend") and "largest weight" in page.inner_text("#legend")
    query = len(ids) - 1  # scaled by the row's largest weight, its largest key is full colour
    page.hover(f"#tokens .chip[data-index='{query}']")
    shades = page.eval_on_selector_all(
        "#tokens .chip", "cs => cs.map(c => +c.style.getPropertyValue('--w'))")
    assert max(shades) == 1.0
    page.select_option("#scale", "weight")
    assert "weight" in page.inner_text("#legend") and "largest" not in page.inner_text("#legend")
    plain = page.eval_on_selector_all(
        "#tokens .chip", "cs => cs.map(c => [+c.style.getPropertyValue('--w'), "
        "+c.dataset.weight])")
    assert all(abs(s - w) < 2e-3 for s, w in plain)  # the weight itself

    visible = page.evaluate(
        "async () => (await import('/web/tokens.js')).visibleText('a  b\\r')")
    assert visible == "a\u2423\u2423b\u240d"  # two spaces, two marks; a carriage return
    assert page.eval_on_selector("#candidates td.name",
                                 "td => getComputedStyle(td).whiteSpace") == "pre"

    page.click("#tabs button[data-view=modelview]")
    cells = page.locator("#modelview td.mv-cell")
    assert cells.count() == 2 * 2  # layers x heads
    page.click("#modelview td.mv-cell[data-layer='1'][data-head='0']")
    large = page.locator("#modelview .large-map[data-layer='1'][data-head='0']")
    assert large.count() == 1
    assert page.input_value("#layer") == "1" and page.input_value("#head") == "0"
    names = [ENC.decode([t]).replace(" ", "\u2423") for t in ids]
    assert large.locator(".label.query").all_inner_texts() == names
    assert large.locator(".label.key").all_inner_texts() == names
    large.locator("canvas").scroll_into_view_if_needed()
    box = large.locator("canvas").bounding_box()
    cell = box["width"] / len(ids)
    page.mouse.move(box["x"] + 2.5 * cell, box["y"] + 7.5 * cell)  # query 7, key 2
    weights, _ = weights_of(url, ids)
    caption = large.locator(".caption").inner_text()
    assert "query 7" in caption and "key 2" in caption
    assert float(caption.rsplit("weight ", 1)[1]) == pytest.approx(weights[1, 0, 7, 2], abs=2e-3)


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
        deadline = time.monotonic() + HANG_SECONDS  # a hang guard
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


@pytest.fixture(scope="module")
def chat_served():
    """A scripted model with gptmini's chat tokens (test_server_chat.py's): its replies to
    TURN1 and TURN2 are known."""
    from helpers import scripted_model
    from test_server_chat import ENC as CHAT_ENC
    from test_server_chat import END, REPLY1, REPLY2, TURN1, TURN2, rendered, script

    from gptmini.generate.engine import Engine
    from gptmini.serve.app import create_app

    model = scripted_model(CHAT_ENC.n_vocab, {
        **script(rendered(TURN1), [*REPLY1.encode(), END]),
        **script(rendered(TURN2), [*REPLY2.encode(), END])}, default=ord("x"))
    url, stop = test_page.serve(create_app(Engine(model, CHAT_ENC, block_size=4), "chat",
                                           api_key="k"))
    yield url
    stop()


def test_chat_mode_inspects_the_whole_rendered_conversation(chat_served, page):
    from test_server_chat import REPLY1, REPLY2, TURN1, TURN2, rendered

    url = chat_served
    open_page(page, url)
    page.click("#modes button[data-mode=chat]")
    assert page.is_hidden("#prompt") and page.is_visible("#chat-input")
    page.fill("#system", "Be brief.")
    page.fill("#temperature", "0")
    page.fill("#chat-input", "Hello")
    page.click("#generate")
    first = rendered(TURN1) + list(REPLY1.encode())
    page.wait_for_selector(f"body[data-attention-tokens='{len(first)}']")
    assert page.inner_text("#conversation .assistant .content") == REPLY1
    assert page.evaluate("window.gptmini.ids") == first
    assert page.locator("#tokens .chip.generated").count() == len(REPLY1)

    page.fill("#chat-input", "How are you?")
    page.press("#chat-input", "Enter")  # the second turn: the whole conversation again
    ids = rendered(TURN2) + list(REPLY2.encode())
    page.wait_for_selector(f"body[data-attention-tokens='{len(ids)}']")
    assert page.evaluate("window.gptmini.ids") == ids
    assert page.eval_on_selector_all("#conversation .content", "cs => cs.map(c => "
                                     "c.textContent)") == ["Hello", REPLY1, "How are you?",
                                                           REPLY2]
    names = page.eval_on_selector_all("#tokens .chip", "cs => cs.map(c => c.textContent)")
    assert names[0] == "<|system|>" and names.count("<|assistant|>") == 2  # the template's
    weights, data = weights_of(url, ids)
    query = len(rendered(TURN1)) + 3  # a token of the first reply
    page.locator("#tokens .chip").nth(query).hover()
    shown = [float(x or 0) for x in page.eval_on_selector_all(
        "#tokens .chip", "cs => cs.map(c => c.dataset.weight)")]
    assert np.allclose(shown[: query + 1], weights[0].mean(0)[query, : query + 1], atol=2e-3)
    logprobs = [float(x) for x in page.eval_on_selector_all(
        "#candidates tr.candidate", "rs => rs.map(r => r.dataset.logprob)")]
    assert logprobs == pytest.approx([v for _, _, v in data["top_logprobs"][query]], abs=1e-6)

    page.fill("#chat-input", "x" * 200)  # past the context: the turn is taken back
    page.click("#generate")
    page.wait_for_selector("body[data-state=error]")
    assert "leaving no room for a reply" in page.inner_text("#message")
    assert page.locator("#conversation .turn").count() == 4
    assert page.input_value("#chat-input") == "x" * 200
    page.click("#new-chat")
    assert page.locator("#conversation .turn").count() == 0
