"""Sampling, generate() and the KV cache: the book's function and what it grew into."""

from dataclasses import replace

import pytest
import torch
from helpers import make_model

from gptmini.generate.loop import (
    generate,
    generate_stream,
    left_pad,
    sample_next_token,
    stream_text,
)
from gptmini.generate.sampling import SamplingParams
from gptmini.model import GPTModel
from gptmini.tokenizer import get_tokenizer

ARCHS = {
    "mha": {},
    "gqa": {"n_heads": 4, "n_kv_heads": 2},
    "mqa": {"n_heads": 4, "n_kv_heads": 1},
    "window": {"window_size": 4},
}


@pytest.fixture
def model() -> GPTModel:
    return make_model()


def test_book_signature_runs_positionally(model):
    idx = torch.randint(0, 64, (1, 6))
    out = generate(model, idx, 5, 16)  # generate(model, idx, max_new_tokens, context_size)
    assert out.shape == (1, 11) and torch.equal(out[:, :6], idx)
    torch.manual_seed(123)
    sampled = generate(model, idx, 5, 16, 1.4, 25)  # temperature, top_k as in chapter 5
    torch.manual_seed(123)
    assert torch.equal(sampled, generate(model, idx, 5, 16, 1.4, 25))


def test_book_generate_works_with_any_logits_module():
    class Bigram(torch.nn.Module):  # no cfg, no cache, no mask: the book's minimal contract
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 10)

        def forward(self, idx):
            return self.emb(idx)

    out = generate(Bigram().eval(), torch.tensor([[1, 2]]), 4, context_size=3)
    assert out.shape == (1, 6)


def test_zero_new_tokens_returns_the_prompt(model):
    idx = torch.randint(0, 64, (2, 3))
    assert torch.equal(generate(model, idx, 0), idx)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_with_cache_equals_without_past_context_length(arch):
    model = make_model(**ARCHS[arch])
    idx = torch.randint(0, 64, (2, 5))
    # 5 + 40 tokens: the context (16) fills, then slides for 29 steps.
    recompute = generate(model, idx, 40)
    cached = generate(model, idx, 40, use_cache=True)
    assert cached.shape == (2, 45)
    assert torch.equal(cached, recompute)


@pytest.mark.parametrize("arch", ["mha", "window"])
def test_cache_equals_recompute_with_a_smaller_context_size_and_long_prompt(arch):
    model = make_model(**ARCHS[arch])
    idx = torch.randint(0, 64, (1, 20))  # longer than both context sizes
    for context_size in (16, 6):
        assert torch.equal(
            generate(model, idx, 12, context_size, use_cache=True),
            generate(model, idx, 12, context_size),
        )


def test_cache_prefills_once_then_feeds_one_token_then_slides(model):
    lengths = []
    model.register_forward_pre_hook(lambda _m, args: lengths.append(args[0].shape[1]))
    generate(model, torch.randint(0, 64, (1, 5)), 14, use_cache=True)
    # Prefill 5, then 11 single tokens up to 16 in context; a 17th token needs the last 16
    # recomputed at every step.
    assert lengths == [5] + [1] * 11 + [16] * 2


def test_cache_grows_past_its_first_buffer():
    model = make_model(context_length=160)
    idx = torch.randint(0, 64, (1, 3))  # 3 + 150 tokens: the cache buffer doubles twice
    assert torch.equal(generate(model, idx, 150, use_cache=True), generate(model, idx, 150))


def test_sampling_with_cache_equals_without(model):
    idx = torch.randint(0, 64, (2, 4))
    kwargs = {"sampling": SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=7)}
    assert torch.equal(
        generate(model, idx, 30, use_cache=True, **kwargs), generate(model, idx, 30, **kwargs)
    )


def test_generation_leaves_the_model_as_it_was(model):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    idx = torch.randint(0, 64, (2, 7))
    logits = model(idx)
    stream = generate_stream(model, torch.zeros(1, 1, dtype=torch.long), 10, use_cache=True)
    next(stream)
    next(stream)  # abandoned half-way
    del stream
    # every position's logits, as before: nothing left behind (e.g. a hook keeping the last)
    assert torch.equal(model(idx), logits)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert not model.training


def test_warns_when_the_model_is_training(model):
    model.train()
    with pytest.warns(UserWarning, match="model.eval"):
        generate(model, torch.zeros(1, 1, dtype=torch.long), 2)


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("arch", ARCHS)
def test_batched_left_padded_prompts_equal_one_by_one(arch, use_cache):
    model = make_model(**ARCHS[arch])
    prompts = [torch.randint(0, 64, (n,)) for n in (1, 4, 9)]
    idx, mask = left_pad(prompts, pad_id=63)
    # 9 + 14 tokens: the longest row slides past context_length 16, the others too later.
    batched = generate(model, idx, 14, attention_mask=mask, use_cache=use_cache)
    for row, prompt in zip(batched, prompts, strict=True):
        alone = generate(model, prompt[None], 14)[0]
        assert torch.equal(row[idx.shape[1]:], alone[len(prompt):])
        assert torch.equal(row[-14 - len(prompt):-14], prompt)


def test_left_pad_layout():
    idx, mask = left_pad([[5, 6], [7]], pad_id=0)
    assert idx.tolist() == [[5, 6], [0, 7]]
    assert mask.tolist() == [[1, 1], [0, 1]]


def test_top_k_1_equals_greedy(model):
    idx = torch.randint(0, 64, (3, 4))
    greedy = generate(model, idx, 15, use_cache=True)
    assert torch.equal(generate(model, idx, 15, 16, 1.5, 1), greedy)  # the book's top_k=1
    for narrow in (SamplingParams(temperature=1.5, top_k=1, seed=0),
                   SamplingParams(temperature=1.5, top_p=1e-6, seed=0)):
        assert torch.equal(generate(model, idx, 15, sampling=narrow), greedy)


def test_temperature_zero_ignores_the_seed_and_draws_nothing(model):
    idx = torch.randint(0, 64, (2, 4))
    state = torch.random.get_rng_state()
    outs = [generate(model, idx, 10, sampling=SamplingParams(top_k=5, seed=s)) for s in (1, 2)]
    outs.append(generate(model, idx, 10))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    assert torch.equal(torch.random.get_rng_state(), state)


def test_same_seed_repeats_and_different_seeds_differ(model):
    idx = torch.randint(0, 64, (1, 4))
    a, b = (generate(model, idx, 30, sampling=SamplingParams(temperature=1.0, seed=11),
                     use_cache=True) for _ in range(2))
    assert torch.equal(a, b)
    assert not torch.equal(a, generate(model, idx, 30, sampling=SamplingParams(
        temperature=1.0, seed=12), use_cache=True))
    gen = torch.Generator().manual_seed(11)  # the book's arguments with a generator
    assert torch.equal(a, generate(model, idx, 30, temperature=1.0, generator=gen,
                                   use_cache=True))


def test_several_samples_per_prompt(model):
    idx = torch.randint(0, 64, (2, 3))
    out = generate(model, idx, 20, sampling=SamplingParams(temperature=1.0, seed=0),
                   num_samples=3, use_cache=True)
    assert out.shape == (6, 23)
    assert torch.equal(out[:3, :3], idx[0].expand(3, 3))
    assert torch.equal(out[3:, :3], idx[1].expand(3, 3))
    assert len({tuple(r.tolist()) for r in out[:3]}) == 3  # different samples
    greedy = generate(model, idx, 5, num_samples=2)
    assert torch.equal(greedy[0], greedy[1])


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    draws = {int(sample_next_token(logits, temperature=1.0, top_p=0.75,
                                   generator=torch.Generator().manual_seed(s)))
             for s in range(200)}
    assert draws == {0, 1}  # 0.5 < 0.75 <= 0.5 + 0.3


def test_top_k_larger_than_the_vocabulary_samples_as_without_top_k(model):
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    for top_k in (4, 1000):  # every id stays possible, drawn exactly as without top-k
        draws = [int(sample_next_token(logits, temperature=1.0, top_k=top_k,
                                       generator=torch.Generator().manual_seed(s)))
                 for s in range(200)]
        plain = [int(sample_next_token(logits, temperature=1.0,
                                       generator=torch.Generator().manual_seed(s)))
                 for s in range(200)]
        assert draws == plain and set(draws) == {0, 1, 2, 3}
    idx = torch.randint(0, 64, (2, 3))
    wide, plain, whole = (generate(model, idx, 12, sampling=SamplingParams(
        temperature=1.0, top_k=k, seed=3)) for k in (1000, None, 64))
    assert torch.equal(wide, plain) and torch.equal(wide, whole)


@pytest.mark.parametrize("use_cache", [True, False])
def test_eos_stops_like_the_book(model, use_cache):
    idx = torch.randint(0, 64, (1, 4))
    full = generate(model, idx, 12)
    eos = int(full[0, 6])  # the third new token
    first = int((full[0, 4:] == eos).nonzero()[0])
    out = generate(model, idx, 12, eos_id=eos, use_cache=use_cache)
    assert torch.equal(out, full[:, : 4 + first])  # the eos itself is not appended


def test_eos_in_a_batch_pads_finished_rows_until_all_stop(model):
    prompts = [torch.randint(0, 64, (n,)) for n in (2, 5)]
    idx, mask = left_pad(prompts)
    full = generate(model, idx, 10, attention_mask=mask)
    eos = int(full[0, 5])  # the first row's first new token... maybe later in row 1
    out = generate(model, idx, 10, eos_id=eos, attention_mask=mask, use_cache=True)
    new = out[:, 5:]
    assert (new[0] == eos).all()  # row 0 finished at once, padded with eos
    row1 = full[1, 5:]
    hits = (row1 == eos).nonzero()
    stop = int(hits[0]) if len(hits) else 10
    assert new.shape[1] == stop and torch.equal(new[1], row1[:stop])


@pytest.mark.parametrize("use_cache", [True, False])
def test_stream_yields_what_generate_returns(model, use_cache):
    idx, mask = left_pad([torch.randint(0, 64, (n,)) for n in (3, 6)])
    kwargs = {"sampling": SamplingParams(temperature=0.9, top_k=30, seed=3),
              "attention_mask": mask, "num_samples": 2, "use_cache": use_cache}
    steps = list(generate_stream(model, idx, 12, **kwargs))
    assert all(s.shape == (4,) for s in steps)
    out = generate(model, idx, 12, **kwargs)
    assert torch.equal(torch.stack(steps, dim=1), out[:, idx.shape[1]:])


def test_stream_text_decodes_what_generate_returns():
    tok = get_tokenizer("gpt2")
    model = make_model(vocab_size=tok.n_vocab, context_length=32)
    pieces = list(stream_text(model, tok, "ROMEO:", 12, stop_at_eos=False))
    ids = tok.encode("ROMEO:")
    out = generate(model, torch.tensor([ids]), 12)
    assert "".join(pieces) == tok.decode(out[0, len(ids):].tolist())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": -0.5}, "temperature must be .* >= 0"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": 0}, "top_k must be an integer >= 1"),
        ({"top_k": -3}, "top_k must be an integer >= 1"),
        ({"top_k": 2.5}, "top_k must be an integer >= 1"),
        ({"num_samples": 0}, "num_samples"),
        ({"sampling": SamplingParams(seed=1), "generator": torch.Generator()},
         "either seed or generator"),
        ({"sampling": SamplingParams(), "temperature": 0.5}, "put every setting in sampling"),
        ({"sampling": SamplingParams(stop=("x",))}, "the engine does"),
        ({"sampling": SamplingParams(logprobs=2)}, "the engine does"),
        ({"context_size": 17}, "exceeds the model's context_length=16"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
    ],
)


def test_bad_input_names_the_argument_and_the_fix(model, kwargs, match):
    kwargs = {"max_new_tokens": 3, **kwargs}
    with pytest.raises(ValueError, match=match):
        generate(model, torch.zeros(1, 2, dtype=torch.long), **kwargs)
    with pytest.raises(ValueError, match=match):
        generate_stream(model, torch.zeros(1, 2, dtype=torch.long), **kwargs)  # no next()


def test_the_sampling_object_takes_every_setting_and_the_call_its_budget(model):
    idx = torch.randint(0, 64, (2, 4))
    settings = SamplingParams(max_new_tokens=50, temperature=1.3, top_k=9, top_p=1e-6, seed=4)
    out = generate(model, idx, 6, sampling=settings)
    assert out.shape == (2, 10)  # the argument's max_new_tokens, not the object's
    assert torch.equal(out, generate(model, idx, 6))  # top_p applied: only the likeliest
    steps = list(generate_stream(model, idx, 6, sampling=settings))
    assert torch.equal(torch.stack(steps, dim=1), out[:, 4:])
    assert not torch.equal(out, generate(model, idx, 6, sampling=replace(settings, top_p=None)))


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"top_p": 0.9}, r"top_p= is a sampling setting: pass sampling=SamplingParams\(top_p"),
    ({"seed": 1}, r"sampling=SamplingParams\(seed"),
    ({"use_cach": True}, "unexpected keyword use_cach=.*use_cache"),
    ({"sampling": {"top_p": 0.9}}, "sampling must be a SamplingParams"),
])
def test_keywords_in_the_wrong_place_say_where_they_go(model, kwargs, match):
    """top_p= and seed= were generate()'s own keywords; they are SamplingParams fields now."""
    for call in (generate, generate_stream):
        with pytest.raises(TypeError, match=match):
            call(model, torch.zeros(1, 2, dtype=torch.long), 3, **kwargs)


def test_bad_prompts_and_masks(model):
    with pytest.raises(ValueError, match=r"unsqueeze\(0\)"):
        generate(model, torch.zeros(4, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="num_tokens >= 1"):
        generate(model, torch.zeros(1, 0, dtype=torch.long), 2)
    right_padded = torch.tensor([[1, 1, 0]])
    with pytest.raises(ValueError, match="left padding"):
        generate(model, torch.zeros(1, 3, dtype=torch.long), 2, attention_mask=right_padded)
    with pytest.raises(ValueError, match="shape of idx"):
        generate(model, torch.zeros(1, 3, dtype=torch.long), 2, attention_mask=torch.ones(1, 2))
    with pytest.raises(ValueError, match="at least one token"):
        left_pad([[1], []])


@pytest.mark.slow
def test_a_model_compiled_in_place_generates_what_it_does_eagerly():
    model = make_model()
    prompt = torch.randint(0, model.cfg.vocab_size, (1, 5))
    eager = generate(model, prompt, 4, use_cache=True)
    model.compile()  # as GPTLitModule(compile=True) does
    try:
        torch.testing.assert_close(generate(model, prompt, 4, use_cache=True), eager)
    finally:
        torch.compiler.reset()


@pytest.mark.parametrize("position", ["rope", "alibi", "none"])
def test_rolling_past_the_context_is_one_pass_with_a_window_of_the_context(position):
    """slide="roll" against its oracle: greedy tokens of a model whose context covers the
    whole sequence, attending through a sliding window of the first model's context."""
    from dataclasses import replace

    from gptmini.model import GPTConfig, GPTModel

    cfg = GPTConfig(vocab_size=64, context_length=12, emb_dim=16, n_heads=2, n_layers=2,
                    drop_rate=0.0, position=position, attn_softcap=8.0)
    torch.manual_seed(3)
    model = GPTModel(cfg).double().eval()
    with torch.no_grad():  # at init positions move the logits by ~1e-3, no draw flips and a
        for weight in model.parameters():  # position bug would pass; sharpened, one shows
            weight.mul_(6)
    oracle = GPTModel(replace(cfg, context_length=64, window_size=12)).double().eval()
    oracle.load_state_dict(model.state_dict())
    prompts, mask = left_pad([[5, 9, 2, 7, 1], [3, 8]])
    # sampled with one seed: equal float64 logits draw equal tokens, and any difference in
    # the logits shows as soon as a draw flips (greedy text of a tiny model repeats itself)
    options = {"attention_mask": mask, "use_cache": True,
               "sampling": SamplingParams(temperature=1.0, seed=0)}
    got = generate(model, prompts, 30, slide="roll", **options)
    assert torch.equal(got, generate(oracle, prompts, 30, **options))
    if position == "rope":  # (recompute crops and re-positions: a different computation)
        assert not torch.equal(got, generate(model, prompts, 30, **options))


def test_rolling_is_refused_where_it_would_not_be_exact(tiny_config):
    from gptmini.model import GPTModel

    model = GPTModel(tiny_config).eval()  # learned positions
    with pytest.raises(ValueError, match="slide='roll'.*position='learned': use "
                                         "slide='recompute'"):
        generate(model, torch.tensor([[1, 2]]), 3, use_cache=True, slide="roll")
    with pytest.raises(ValueError, match="slide must be 'recompute' or 'roll'"):
        generate(model, torch.tensor([[1, 2]]), 3, slide="shift")
