"""Head roles, on attention patterns and models built by hand to have a known role."""

import pytest
import torch

from gptmini.analysis.heads import head_roles, role_scores
from gptmini.model import GPTConfig, GPTModel

PERIOD, TOKENS = 5, 11  # [first] + r + r


def pattern(keys_of) -> torch.Tensor:
    """One-hot attention (TOKENS, TOKENS): query i puts all its weight on key keys_of(i)."""
    weights = torch.zeros(TOKENS, TOKENS)
    for i in range(TOKENS):
        weights[i, keys_of(i)] = 1.0
    return weights


@pytest.mark.parametrize(("keys_of", "expected"), [
    (lambda i: max(i - 1, 0), (1.0, 0.0, 1 / 10)),  # previous token (query 1's is the first)
    (lambda i: 0, (1 / 10, 0.0, 1.0)),  # a sink
    (lambda i: i - PERIOD + 1 if i > PERIOD else 0, (1 / 10, 1.0, 5 / 10)),  # induction
    (lambda i: i, (0.0, 0.0, 0.0)),  # itself
])
def test_scores_of_one_hot_patterns_are_the_shares_counted_by_hand(keys_of, expected):
    scores = role_scores(pattern(keys_of), PERIOD)
    assert [round(float(s), 6) for s in scores] == pytest.approx(expected)


def test_scores_keep_leading_dimensions_and_refuse_a_wrong_length():
    weights = torch.stack([pattern(lambda i: 0), pattern(lambda i: max(i - 1, 0))])
    previous, induction, sink = role_scores(weights[None], PERIOD)  # (1, 2)
    assert previous[0].tolist() == pytest.approx([0.1, 1.0]) and sink.shape == (1, 2)
    with pytest.raises(ValueError, match="2 \\* period \\+ 1 tokens"):
        role_scores(weights, 4)


def built_model() -> GPTModel:
    """One layer, two heads: head 0 attends to the previous token, head 1 to the first.

    Tokens carry no information (zero embeddings); position i is 10 * e_i in the first 16
    of 32 dimensions. Head 0's query reads position i and its key moves position j to
    j + 1, so query i matches key i - 1. Head 1's query is its bias alone (a constant) and
    its key reads position 0 only, so every query matches key 0."""
    cfg = GPTConfig(vocab_size=16, context_length=16, emb_dim=32, n_heads=2, n_layers=1,
                    drop_rate=0.0, qkv_bias=True)
    model = GPTModel(cfg).eval()
    att, d = model.trf_blocks[0].att, 16
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.trf_blocks[0].norm1.weight.fill_(1.0)
        model.pos_emb.weight[:, :d] = 10 * torch.eye(d)
        att.W_query.weight[:d, :d] = 4 * torch.eye(d)  # head 0: rows 0..15
        att.W_key.weight[1:d, : d - 1] = torch.eye(d - 1)  # position j -> j + 1
        att.W_query.bias[d:] = 1.0  # head 1: rows 16..31, the same query everywhere
        att.W_key.weight[d, 0] = 20.0  # only position 0 gives head 1 a key
    return model


def test_a_built_previous_token_head_and_a_built_sink_are_named():
    roles = head_roles(built_model(), period=7)
    previous, sink = roles.previous_token[0], roles.sink[0]
    assert previous[0] > 0.9 and sink[1] > 0.9, roles
    assert previous[1] < 0.2 and sink[0] < 0.2, roles  # each head has one role
    assert roles.induction.max() < 0.2 and roles.period == 7
    assert roles.to_dict()["sink"][0][1] == pytest.approx(float(sink[1]))


def test_head_roles_restore_the_mode_and_check_the_period():
    model = built_model().train()
    state = torch.random.get_rng_state()
    head_roles(model, period=3, batch=2)
    assert model.training and torch.equal(state, torch.random.get_rng_state())
    with pytest.raises(ValueError, match="period must be in 2..7"):
        head_roles(model, period=8)
