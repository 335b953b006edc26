"""One settings object and one batched sampler: a row's token depends on its own logits,
settings and generator only."""

import os

import pytest
import torch
from helpers import HANG_SECONDS
from hypothesis import given, settings
from hypothesis import strategies as st

from gptmini.generate.sampling import (
    RequestError,
    SamplingError,
    SamplingParams,
    sample,
    sample_next_token,
    seeded_generator,
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


MIN_P_FIELD = '''    min_p: float | None = None
    """Keep the tokens at least min_p times as likely as the likeliest (a toy option)."""

'''
MIN_P_CHECK = '''        m = self.min_p
        if m is not None and not (isinstance(m, int | float) and 0 <= m <= 1):
            raise SamplingError("min_p", f"min_p must be a number in [0, 1], got {m!r}")
'''
MIN_P_FILTER = '''    if any(r.min_p is not None for r in rows):
        logits = logits.clone()
        for i, r in enumerate(rows):
            if r.min_p is not None:
                probs = torch.softmax(logits[i], dim=-1)
                logits[i] = logits[i].masked_fill(probs < r.min_p * probs.max(), -torch.inf)
'''
USE_MIN_P = '''
import argparse, json, sys
from pathlib import Path

import torch

import gptmini
from gptmini.generate import SamplingParams, generate
from gptmini.generate.batch_file import generate_batch, read_batch_file
from gptmini.generate.engine import Engine
from gptmini.model import GPTConfig, GPTModel
from gptmini.tokenizer import byte_tokenizer

assert gptmini.__file__.startswith(sys.argv[1]), gptmini.__file__  # the patched copy
enc = byte_tokenizer()
torch.manual_seed(0)
model = GPTModel(GPTConfig(vocab_size=enc.n_vocab, context_length=32, emb_dim=16, n_heads=2,
                           n_layers=2, drop_rate=0.0)).double().eval()
prompt = enc.encode("ROMEO:")
idx = torch.tensor([prompt])
greedy = generate(model, idx, 8)[0, 6:].tolist()
hot = generate(model, idx, 8, sampling=SamplingParams(temperature=5.0, seed=0))
assert hot[0, 6:].tolist() != greedy, "the test needs a temperature that leaves greedy"
# min_p=1 keeps only the likeliest token: greedy text at any temperature
only_best = SamplingParams(temperature=5.0, seed=0, min_p=1.0)
assert generate(model, idx, 8, sampling=only_best)[0, 6:].tolist() == greedy, "generate()"
engine = Engine(model, enc, block_size=4)
done = engine.generate([prompt], max_new_tokens=8, temperature=5.0, seed=0, min_p=1.0)
assert done[0].tokens == greedy, "Engine"
expected = enc.decode(generate(model, idx, 8, eos_id=enc.eot_token)[0, 6:].tolist())

Path("p.jsonl").write_text(json.dumps({"prompt": "ROMEO:", "min_p": 1.0}) + "\\n")
assert read_batch_file(Path("p.jsonl"))[0]["min_p"] == 1.0
args = argparse.Namespace(batch_file=Path("p.jsonl"), output=Path("out.jsonl"), max_batch=2,
                          max_new_tokens=8, temperature=5.0, top_p=None, seed=0)
generate_batch(model, enc, args, None)
assert json.loads(Path("out.jsonl").read_text())["text"] == expected, "--batch_file"

try:
    from fastapi.testclient import TestClient
except ImportError:  # (the server's extra is not installed)
    sys.exit(0)
from gptmini.serve.app import create_app
from gptmini.serve.schema import parse

body = {"model": "tiny", "prompt": "ROMEO:", "max_tokens": 8, "temperature": 5.0, "seed": 0,
        "min_p": 1.0}
assert parse(body, "tiny").sampling.min_p == 1.0
with TestClient(create_app(Engine(model, enc, block_size=4), "tiny")) as client:
    answer = client.post("/v1/completions", json={**body, "n": 2}).json()
    assert [c["text"] for c in answer["choices"]] == [expected] * 2, ("server", answer)
    error = client.post("/v1/completions", json={**body, "min_p": 2}).json()["error"]
    assert error["param"] == "min_p" and "min_p must be a number in [0, 1]" in error["message"]
'''


def test_a_new_sampling_option_is_one_edit_of_sampling_py(tmp_path):
    """What the README's "where a change goes" promises: a toy option (min_p) added to
    SamplingParams and `sample` alone, in a copy of the package, is taken and applied by
    generate(), the engine, --batch_file records and the server's requests."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    package = Path(__file__).resolve().parents[2] / "gptmini"
    shutil.copytree(package, tmp_path / "gptmini",
                    ignore=shutil.ignore_patterns("__pycache__"))
    sampling = tmp_path / "gptmini" / "generate" / "sampling.py"
    source = sampling.read_text()
    anchors = ["    def __post_init__(self):\n", "    logits = logits.float()"]
    assert all(source.count(a) == 1 for a in anchors), "update this test's patch anchors"
    source = source.replace(anchors[0], MIN_P_FIELD + anchors[0] + MIN_P_CHECK)
    line_end = source.index("\n", source.index(anchors[1])) + 1
    sampling.write_text(source[:line_end] + MIN_P_FILTER + source[line_end:])
    result = subprocess.run([sys.executable, "-c", USE_MIN_P, str(tmp_path)], cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(tmp_path)},
                            capture_output=True, text=True, timeout=HANG_SECONDS)
    assert result.returncode == 0, result.stderr[-3000:]


SEED_PAIRS = [(1, 2**32 + 1), (0, 2**32), (2**32 - 1, -1), (5, 2**63 + 5), (7, -(2**63) + 7),
              (2**40, 2**40 + 2**32), (-1, -2)]


@pytest.mark.parametrize(("a", "b"), SEED_PAIRS)
def test_seeds_that_differ_only_above_32_bits_draw_different_streams(a, b):
    """torch's CPU generator keeps 32 bits of manual_seed's value: these pairs drew the
    same numbers before the seed was mixed (issue 36 item 6)."""
    draws = [torch.rand(8, generator=seeded_generator(s)) for s in (a, b)]
    assert not torch.equal(*draws)
    params = [SamplingParams(temperature=1.0, seed=s).generator() for s in (a, b)]
    assert not torch.equal(*(torch.rand(8, generator=g) for g in params))
    assert torch.equal(torch.rand(8, generator=seeded_generator(a)), draws[0])  # a function


@pytest.mark.parametrize("seed", [0, 1, 1234, 2**31, 2**32 - 1])
def test_seeds_below_2_to_the_32_keep_the_streams_they_always_gave(seed):
    assert torch.equal(torch.rand(8, generator=seeded_generator(seed)),
                       torch.rand(8, generator=torch.Generator().manual_seed(seed)))
