"""The page's endpoints over plain HTTP: the attention of a text (against attention computed
here by hand for the first layer, and against the standard path's logits), its limits and
encodings, the checkpoint panel and the head roles."""

import base64
import json
import threading

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from helpers import save_checkpoint, write_metrics  # noqa: E402

from gptmini.analysis.heads import head_roles  # noqa: E402
from gptmini.checkpoint import load_checkpoint  # noqa: E402
from gptmini.generate.engine import Engine  # noqa: E402
from gptmini.model import GPTConfig, GPTModel  # noqa: E402
from gptmini.serve.app import create_app  # noqa: E402
from gptmini.serve.page import checkpoint_panel, parameter_parts  # noqa: E402
from gptmini.tokenizer import byte_tokenizer  # noqa: E402

ENC = byte_tokenizer()
WINDOW = 6


def serve(app):
    """`app` on a free loopback port in a thread: (url, stop)."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive(), "the server did not start"
        threading.Event().wait(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]

    def stop():
        server.should_exit = True
        thread.join(timeout=10)

    return f"http://127.0.0.1:{port}", stop


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A checkpoint of a windowed model saved in a run directory with logged metrics."""
    root = tmp_path_factory.mktemp("run")
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=ENC.n_vocab, context_length=48, emb_dim=32, n_heads=2,
                    n_layers=2, drop_rate=0.0, window_size=WINDOW)
    (root / "checkpoints").mkdir()
    path = save_checkpoint(GPTModel(cfg).eval(), root / "checkpoints" / "last.ckpt", "byte")
    write_metrics(root / "logs" / "version_0" / "metrics.csv", [
        {"epoch": 0, "step": 9, "train/loss": 5.0}, {"epoch": 0, "step": 19, "train/loss": 4.0},
        {"epoch": 0, "step": 19, "val/loss": 4.5}])
    return path


@pytest.fixture(scope="module")
def served(run):
    model, tokenizer, hparams = load_checkpoint(run)
    engine = Engine(model, tokenizer, block_size=4)
    app = create_app(engine, "tiny", api_key="k", attention_tokens=40,
                     checkpoint=checkpoint_panel(model, tokenizer, run, hparams))
    url, stop = serve(app)
    yield url, model
    stop()


KEY = {"authorization": "Bearer k"}


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/gptmini/attention", json=body, headers=KEY, timeout=30)


def triangle(data: dict) -> np.ndarray:
    """The weights of an answer as (n_layers, n_heads, num_tokens, num_tokens)."""
    n, layers, heads = data["num_tokens"], data["n_layers"], data["n_heads"]
    raw = base64.b64decode(data["weights"]["data"])
    flat = (np.frombuffer(raw, "<f2").astype(np.float32) if data["weights"]["encoding"] ==
            "float16" else np.frombuffer(raw, np.uint8) / 255.0)
    out = np.zeros((layers, heads, n, n), np.float32)
    rows, cols = np.tril_indices(n)
    out[:, :, rows, cols] = flat.reshape(layers, heads, -1)
    return out


def by_hand_first_layer(model: GPTModel, ids: list[int]) -> torch.Tensor:
    """Layer 0's weights computed from its parameters here: scores, window, softmax."""
    cfg, att = model.cfg, model.trf_blocks[0].att
    with torch.no_grad():
        x = model.tok_emb.weight[ids] + model.pos_emb.weight[: len(ids)]
        x = torch.nn.functional.layer_norm(x, (cfg.emb_dim,), model.trf_blocks[0].norm1.weight,
                                           model.trf_blocks[0].norm1.bias, cfg.norm_eps)
        d = cfg.emb_dim // cfg.n_heads
        q = att.W_query(x).view(len(ids), cfg.n_heads, d).transpose(0, 1)
        k = att.W_key(x).view(len(ids), cfg.n_heads, d).transpose(0, 1)
        scores = q @ k.transpose(1, 2) / d ** 0.5  # (n_heads, num_tokens, num_tokens)
        i, j = torch.arange(len(ids))[:, None], torch.arange(len(ids))[None, :]
        scores[:, ~((j <= i) & (j > i - WINDOW))] = -torch.inf
        return torch.softmax(scores, -1)


def test_attention_of_a_text_equals_attention_by_hand_with_its_window(served):
    url, model = served
    text = "ROMEO. But soft, what light"
    data = post(url, {"prompt": text}).json()
    ids = ENC.encode(text)
    assert data["token_ids"] == ids and "".join(data["tokens"]) == text
    weights = triangle(data)
    assert np.allclose(weights[0], by_hand_first_layer(model, ids).numpy(), atol=1e-3)
    assert np.allclose(weights.sum(-1), 1.0, atol=1e-2)  # every row, every layer
    bits = np.unpackbits(np.frombuffer(base64.b64decode(data["mask"]), np.uint8))
    rows, cols = np.tril_indices(len(ids))
    window = (cols > rows - WINDOW)
    assert (bits[: len(rows)] == window).all()  # the mask sent is the window
    assert (weights[:, :, rows[~window], cols[~window]] == 0).all()


def test_candidates_are_the_models_log_probabilities(served):
    url, model = served
    ids = ENC.encode("JULIET. O Romeo")
    data = post(url, {"prompt": ids, "top_logprobs": 5}).json()
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids]))[0], -1)  # the sdpa path
    for i, row in enumerate(data["top_logprobs"]):
        top = torch.topk(logp[i], 5)
        assert [t for t, _, _ in row] == top.indices.tolist()
        assert [v for _, _, v in row] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert [name for _, name, _ in row] == [ENC.decode([t]) if t < 128 else name
                                               for t, name, _ in row]
    assert data["token_logprobs"][0] is None
    assert data["token_logprobs"][3] == pytest.approx(float(logp[2, ids[3]]), abs=1e-4)


def test_encodings_agree_and_the_compact_one_is_smaller(served):
    url, _ = served
    text = "To be, or not to be, that is the"
    answers = {e: post(url, {"prompt": text, "encoding": e}) for e in ("float16", "uint8",
                                                                      "json")}
    half = triangle(answers["float16"].json())
    assert np.abs(triangle(answers["uint8"].json()) - half).max() <= 1 / 255 + 1e-3
    lists = answers["json"].json()
    rows, cols = np.tril_indices(lists["num_tokens"])
    assert np.allclose(np.array(lists["weights"]["data"]), half[:, :, rows, cols], atol=1e-3)
    size = {e: len(json.dumps(a.json()["weights"])) for e, a in answers.items()}
    assert size["float16"] < size["json"] / 3 and size["uint8"] < size["float16"] * 0.6


@pytest.mark.parametrize(("body", "status", "message", "param"), [
    ({"prompt": "x" * 41}, 400, "the text has 41 tokens; /gptmini/attention takes at most 40",
     "prompt"),
    ({"prompt": []}, 400, "prompt must be a string or a non-empty list", "prompt"),
    ({"prompt": [999]}, 400, "token ids in [0, 257)", "prompt"),
    ({"prompt": "a", "top_logprobs": 21}, 400, "top_logprobs must be an integer in 0..20",
     "top_logprobs"),
    ({"prompt": "a", "encoding": "png"}, 400, "encoding must be one of", "encoding"),
    ({"prompt": "a", "layers": [0]}, 400, "unsupported field 'layers'", "layers"),
])
def test_bad_attention_requests_are_400s_naming_the_field(served, body, status, message,
                                                          param):
    answer = post(served[0], body)
    assert answer.status_code == status
    assert message in answer.json()["error"]["message"]
    assert answer.json()["error"]["param"] == param


def test_the_data_endpoints_need_the_key_and_the_page_does_not(served):
    url, _ = served
    for path in ("/gptmini/checkpoint", "/gptmini/heads"):
        assert httpx.get(f"{url}{path}").status_code == 401
    assert httpx.post(f"{url}/gptmini/attention", json={"prompt": "a"}).status_code == 401
    page = httpx.get(f"{url}/")
    assert page.status_code == 200 and 'src="/web/app.js"' in page.text
    for name in ("app.js", "weights.js", "panels.js", "style.css"):
        assert httpx.get(f"{url}/web/{name}").status_code == 200
    missing = httpx.get(f"{url}/web/../server.py")
    assert missing.status_code == 404


def test_checkpoint_panel_and_head_roles(served, run):
    url, model = served
    info = httpx.get(f"{url}/gptmini/checkpoint", headers=KEY).json()
    assert info["steps"] == 1 and info["tokenizer"] == {"name": "byte", "n_vocab": 257}
    assert info["parameters"] == sum(p.numel() for p in model.parameters())
    assert info["settings"]["window_size"] == WINDOW and info["model"] == "tiny"
    assert info["curves"]["train/loss"] == {"steps": [9, 19], "values": [5.0, 4.0],
                                            "non_finite_steps": []}
    assert info["val_loss"] == 4.5 and info["val_bpb"] is None
    roles = httpx.get(f"{url}/gptmini/heads", headers=KEY).json()
    assert roles == json.loads(json.dumps(head_roles(model).to_dict()))
    alone = checkpoint_panel(model, ENC)  # no path: settings alone
    assert alone["steps"] is None and alone["curves"] == {}


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("position", ["learned", "rope"])
def test_parameter_parts_count_a_tied_head_once_and_say_so(tied, position):
    cfg = GPTConfig(vocab_size=64, context_length=16, emb_dim=16, n_heads=2, n_layers=2,
                    tie_weights=tied, position=position)
    model = GPTModel(cfg)
    blocks = sum(p.numel() for name, p in model.named_parameters()
                 if name.startswith(("trf_blocks.", "final_norm.")))
    table = cfg.vocab_width * cfg.emb_dim  # from the settings, not from the module
    assert parameter_parts(model) == {
        "blocks": blocks, "token_embedding": table,
        "position_embedding": cfg.context_length * cfg.emb_dim if position == "learned" else 0,
        "output_head": 0 if tied else table}
    panel = checkpoint_panel(model, ENC)
    assert panel["tied_weights"] is tied
    assert sum(panel["parameter_parts"].values()) == panel["parameters"]


# --- what the page's endpoints answer for odd runs and models -----------------------------


def small_app(model, checkpoint: dict | None = None):
    from fastapi.testclient import TestClient

    app = create_app(Engine(model.eval(), ENC, block_size=4), "odd", checkpoint=checkpoint)
    return TestClient(app)


def test_a_nan_in_the_runs_metrics_is_left_out_of_its_curve_and_named(run, tmp_path):
    """Before: GET /gptmini/checkpoint answered 500 "Out of range float values are not JSON
    compliant" for a run whose loss went NaN."""
    import shutil

    root = tmp_path / "run"
    shutil.copytree(run.parent.parent, root)
    write_metrics(root / "logs" / "version_0" / "metrics.csv", [
        {"epoch": 0, "step": 9, "train/loss": 5.0},
        {"epoch": 0, "step": 19, "train/loss": float("nan")},
        {"epoch": 0, "step": 19, "val/loss": float("inf")}])
    model, tokenizer, hparams = load_checkpoint(root / "checkpoints" / "last.ckpt")
    panel = checkpoint_panel(model, tokenizer, root / "checkpoints" / "last.ckpt", hparams)
    json.dumps(panel, allow_nan=False)  # what the server's JSON response does
    assert panel["curves"]["train/loss"] == {"steps": [9], "values": [5.0],
                                             "non_finite_steps": [19]}
    assert panel["val_loss"] is None
    with small_app(model, panel) as client:
        answer = client.get("/gptmini/checkpoint")
        assert answer.status_code == 200 and answer.json()["curves"] == panel["curves"]


def test_a_metrics_cell_over_csvs_limit_does_not_stop_the_server(run, tmp_path):
    """Before: serve.py refused to start (_csv.Error: field larger than field limit)."""
    import shutil

    root = tmp_path / "run"
    shutil.copytree(run.parent.parent, root)
    metrics = root / "logs" / "version_0" / "metrics.csv"
    with open(metrics, "a", newline="") as file:
        file.write('0,29,,"' + "1" * 200_000 + '",,,\r\n')
    model, tokenizer, hparams = load_checkpoint(root / "checkpoints" / "last.ckpt")
    with pytest.warns(UserWarning, match=f"{metrics}: skipped 1 row"):
        panel = checkpoint_panel(model, tokenizer, root / "checkpoints" / "last.ckpt", hparams)
    assert panel["curves"]["train/loss"]["steps"] == [9, 19]


def test_head_roles_of_a_context_too_short_are_a_422_that_says_why():
    """Before: a bare 500 (a ValueError from head_roles) for context_length 4."""
    model = GPTModel(GPTConfig(vocab_size=ENC.n_vocab, context_length=4, emb_dim=16,
                               n_heads=2, n_layers=1, drop_rate=0.0))
    with small_app(model) as client:
        answer = client.get("/gptmini/heads")
        assert answer.status_code == 422
        assert "at least 5 tokens); this model's context_length is 4" in (
            answer.json()["error"]["message"])
        assert client.post("/gptmini/attention", json={"prompt": "abcd"}).status_code == 200


def test_a_model_computing_nan_is_answered_a_500_that_says_so():
    """Before: /gptmini/attention gave a bare 500 for a model whose weights hold NaN (loading
    refuses such a checkpoint; weights that overflow in the served dtype give the same)."""
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(vocab_size=ENC.n_vocab, context_length=16, emb_dim=16,
                               n_heads=2, n_layers=1, drop_rate=0.0))
    with torch.no_grad():
        model.trf_blocks[0].att.W_query.weight[0, 0] = float("nan")
    with small_app(model) as client:
        for answer in (client.post("/gptmini/attention", json={"prompt": "abc"}),
                       client.get("/gptmini/heads")):
            assert answer.status_code == 500
            assert "are not finite (NaN or inf)" in answer.json()["error"]["message"]
