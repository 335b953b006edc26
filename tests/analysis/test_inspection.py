"""What the page shows of a text, packed: decoded here independently of the page, for the
position schemes and masks a model can have."""

import base64

import numpy as np
import pytest
import torch

from gptmini.analysis.inspection import inspect_text, pack
from gptmini.model import GPTConfig, GPTModel
from gptmini.tokenizer import byte_tokenizer

ENC = byte_tokenizer()
TEXT = "ROMEO. But soft, what light"


def unpack(data: dict) -> tuple[np.ndarray, np.ndarray]:
    """(weights (n_layers, n_heads, n, n), allowed (n, n)) from a packed answer."""
    n = data["num_tokens"]
    rows, cols = np.tril_indices(n)
    weights = np.zeros((data["n_layers"], data["n_heads"], n, n), np.float32)
    flat = np.frombuffer(base64.b64decode(data["weights"]["data"]), "<f2")
    weights[:, :, rows, cols] = flat.reshape(data["n_layers"], data["n_heads"], -1)
    allowed = np.zeros((n, n), bool)
    bits = np.unpackbits(np.frombuffer(base64.b64decode(data["mask"]), np.uint8))
    allowed[rows, cols] = bits[: len(rows)] == 1
    return weights, allowed


@pytest.mark.parametrize("options", [
    {"window_size": 5}, {"position": "rope", "window_size": 4}, {"position": "alibi"},
    {"n_kv_heads": 1},
])
def test_packed_weights_and_mask_are_the_models_for_every_position_scheme(options):
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(vocab_size=ENC.n_vocab, context_length=32, emb_dim=32,
                               n_heads=2, n_layers=2, drop_rate=0.0, **options)).eval()
    ids = ENC.encode(TEXT)
    data = pack(inspect_text(model, ids, top=3), ENC)
    weights, allowed = unpack(data)
    with torch.no_grad():
        expected = model.attention_weights(torch.tensor([ids]))
        logits = model(torch.tensor([ids]))  # a pass of its own: the page's logits
    assert np.allclose(weights, torch.stack([w[0] for w in expected]).numpy(), atol=1e-3)
    i, j = np.indices((len(ids), len(ids)))
    window = options.get("window_size", len(ids))
    assert (allowed == ((j <= i) & (j > i - window))).all()  # the window, drawn as masked
    assert np.allclose(weights.sum(-1), 1, atol=1e-2) and (weights[:, :, ~allowed] == 0).all()
    top = torch.topk(torch.log_softmax(logits[0], -1), 3)
    assert [[t for t, _, _ in row] for row in data["top_logprobs"]] == top.indices.tolist()


def test_an_empty_text_is_refused_and_the_mode_is_restored(tiny_config):
    model = GPTModel(tiny_config).train()
    with pytest.raises(ValueError, match="ids is empty"):
        inspect_text(model, [])
    inspect_text(model, [1, 2, 3])
    assert model.training
    with pytest.raises(ValueError, match="encoding must be one of"):
        pack(inspect_text(model, [1, 2]), ENC, "png")


def test_local_and_global_layers_show_each_its_own_window():
    """With layer_windows the page's mask is what some layer may see (causal here), and a
    local layer's weights are 0 past its window where the global layer's are not."""
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(vocab_size=64, context_length=16, emb_dim=16, n_heads=2,
                               n_layers=2, drop_rate=0.0, layer_windows=[3, None]))
    seen = inspect_text(model, list(range(8)))
    assert torch.equal(seen.allowed, torch.ones(8, 8, dtype=torch.bool).tril())
    far = torch.ones(8, 8, dtype=torch.bool).tril(-3)  # keys 3 or more positions back
    assert (seen.weights[0][:, far] == 0).all()
    assert (seen.weights[1][:, far] > 0).all()
