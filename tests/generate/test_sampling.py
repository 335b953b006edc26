"""One settings object and one batched sampler: a row's token depends on its own logits,
settings and generator only."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gptmini.generate.sampling import (
    RequestError,
    SamplingError,
    SamplingParams,
    sample,
    sample_next_token,
)

SETTINGS = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.5, 1.0, 1.7]),
    top_k=st.sampled_from([None, 1, 3, 40]),
    top_p=st.sampled_from([None, 0.3, 0.9, 1.0]),
    seed=st.integers(0, 2**40),
)


@settings(max_examples=40, deadline=None)
@given(rows=st.lists(SETTINGS, min_size=1, max_size=6), data=st.data())
def test_each_row_draws_what_it_would_draw_alone(rows, data):
    """Mixed temperatures, top-k, top-p and generators in one call, against each row sampled
    alone with the per-call sampler."""
    logits = torch.randn(len(rows), 50, generator=torch.Generator().manual_seed(len(rows)))
    # a few rows share torch's global generator: those are drawn together, not compared
    shared = data.draw(st.lists(st.booleans(), min_size=len(rows), max_size=len(rows)))
    generators = [None if s else p.generator() for p, s in zip(rows, shared, strict=True)]
    got = sample(logits, rows, generators)
    for i, (p, s) in enumerate(zip(rows, shared, strict=True)):
        if s and p.temperature != 0:
            continue
        alone = sample_next_token(logits[i:i + 1], temperature=p.temperature, top_k=p.top_k,
                                  top_p=p.top_p, generator=p.generator())
        assert int(got[i]) == int(alone[0]), f"row {i}: {p}"


def test_one_setting_and_one_generator_for_a_batch_draw_as_one_call():
    """generate()'s case: the same numbers as one multinomial over the whole batch."""
    logits = torch.randn(4, 30)
    params = SamplingParams(temperature=0.8)
    got = sample(logits, params, torch.Generator().manual_seed(3))
    want = torch.multinomial(torch.softmax(logits / 0.8, dim=-1), 1,
                             generator=torch.Generator().manual_seed(3)).squeeze(-1)
    assert torch.equal(got, want)


def test_greedy_rows_draw_no_random_numbers_and_the_logits_are_left_alone():
    logits = torch.randn(3, 20)
    before = logits.clone()
    generator = torch.Generator().manual_seed(0)
    state = generator.get_state()
    got = sample(logits, SamplingParams(top_k=2), [generator] * 3)
    assert torch.equal(got, logits.argmax(dim=-1))
    assert torch.equal(generator.get_state(), state)
    assert torch.equal(logits, before)  # top-k filtered a copy


@pytest.mark.parametrize(("fields", "field", "match"), [
    ({"temperature": True}, "temperature", "finite number >= 0, got True"),
    ({"temperature": float("nan")}, "temperature", "finite number"),
    ({"top_k": 0}, "top_k", "integer >= 1"),
    ({"top_p": 1.5}, "top_p", r"in \(0, 1\]"),
    ({"top_p": 0.0}, "top_p", r"in \(0, 1\]"),
    ({"top_p": True}, "top_p", r"a number in \(0, 1\], got True \(a boolean\)"),
    ({"max_new_tokens": -1}, "max_new_tokens", "integer >= 0"),
    ({"seed": 2**70}, "seed", r"integer of 64 bits \(in \[-2\*\*63, 2\*\*64\)\).*seed % 2\*\*63"),
    ({"seed": "7"}, "seed", "integer"),
    ({"stop": ("",)}, "stop", "non-empty strings"),
    ({"stop": 5}, "stop", r"non-empty strings.*got 5 \(a number\)"),
    ({"stop_ids": (1, "2")}, "stop_ids", "token ids"),
    ({"logprobs": 21}, "logprobs", r"integer in 0\.\.20"),
    ({"logprobs": True}, "logprobs", "integer"),
])
def test_bad_settings_are_refused_naming_their_field(fields, field, match):
    with pytest.raises(SamplingError, match=match) as err:
        SamplingParams(**fields)
    assert err.value.field == field
    assert isinstance(err.value, ValueError)


def test_mismatched_rows_are_refused():
    with pytest.raises(ValueError, match="3 rows of logits but 2 settings"):
        sample(torch.randn(3, 5), [SamplingParams()] * 2)


def test_settings_come_as_json_values_and_are_kept_as_tuples():
    """The readers of settings (the engine's keywords, the server, batch files) pass plain
    values: a JSON array, null, or one stop string."""
    params = SamplingParams(stop="\n\n", stop_ids=[3, 4])
    assert params.stop == ("\n\n",) and params.stop_ids == (3, 4)
    assert SamplingParams(stop=["a", "b"], stop_ids=None) == SamplingParams(stop=("a", "b"))
    hash(params)  # still frozen and hashable


def test_a_refusal_says_its_field_in_a_callers_own_words():
    with pytest.raises(SamplingError) as err:
        SamplingParams(max_new_tokens=-1)
    assert err.value.message_for("max_tokens").startswith("max_tokens must be an integer >= 0")
    assert "max_new_tokens" not in err.value.message_for("max_tokens")
    assert RequestError("top_k", "top_k must be >= 1, not top_kk").message_for("k") == (
        "k must be >= 1, not top_kk")  # whole words only

