"""The engine against `generate()`: the same tokens for every request, whatever the batch.

Every identical-token test runs in float64: float32 kernels differ between batch shapes
(a padded decode batch vs one prompt alone) by more than a near-tie between two logits.
"""

import threading

import pytest
import torch
from helpers import random_requests

from gptmini.generate.engine import Engine, SamplingParams
from gptmini.generate.loop import generate
from gptmini.generate.sampling import RequestError
from gptmini.model import GPTConfig, GPTModel
from gptmini.tokenizer import byte_tokenizer

CONTEXT = 48


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=257, context_length=CONTEXT, emb_dim=32, n_heads=4,
                    n_layers=2, drop_rate=0.0)
    return GPTModel(cfg).double().eval()


def alone(model, prompt, max_new_tokens, **settings) -> list[int]:
    """The oracle: generate() on this prompt by itself, with the KV cache."""
    out = generate(model, torch.tensor([prompt]), max_new_tokens, use_cache=True,
                   sampling=SamplingParams(**settings))
    return out[0, len(prompt):].tolist()


def run(engine, requests, cancel_at=None, **settings):
    """Add each request at its arrival step and step until all are done."""
    added, step = [], 0
    while len(added) < len(requests) or engine.has_work:
        for prompt, max_new, arrival in requests[len(added):]:
            if arrival > step:
                break
            added.append(engine.add_request(prompt, max_new_tokens=max_new, **settings))
        if cancel_at and step in cancel_at:
            engine.cancel(added[cancel_at[step]])
        engine.step()
        step += 1
    return added


@pytest.mark.parametrize(("num_blocks", "shared_prefix", "step_tokens"), [
    (None, 0, None), (None, 20, None), (14, 0, None), (14, 20, None),
    (None, 0, 7), (14, 20, 10),  # chunked prefill: prompts of up to 40 tokens, 7 a step
])
def test_thirty_requests_each_get_what_generate_gives_it_alone(model, num_blocks, shared_prefix,
                                                               step_tokens):
    """Mixed lengths, staggered arrivals, prompts that slide past the context; with 14
    blocks of 4 the pool cannot hold them all, so requests are preempted and recomputed."""
    requests = sorted(random_requests(30, seed=1, shared_prefix=shared_prefix),
                      key=lambda r: r[2])
    engine = Engine(model, block_size=4, num_blocks=num_blocks, max_batch=8,
                    max_step_tokens=step_tokens)
    done = run(engine, requests)
    for (prompt, max_new, _), request in zip(requests, done, strict=True):
        assert request.tokens == alone(model, prompt, max_new), request.id
        assert request.finish_reason == "length"
    assert (engine.num_preemptions > 0) == (num_blocks is not None)
    assert engine.blocks.in_use() == 0 and engine.blocks.num_free == engine.blocks.num_blocks


def test_stop_ids_stop_strings_and_cancellations(model):
    enc = byte_tokenizer()
    requests = sorted(random_requests(30, seed=2), key=lambda r: r[2])
    engine = Engine(model, enc, block_size=4, max_batch=8)
    refs = [alone(model, p, m) for p, m, _ in requests]
    added = []
    for i, ((prompt, max_new, _), ref) in enumerate(zip(requests, refs, strict=True)):
        if i % 3 == 1 and len(ref) > 3:  # stop at the third token's id
            added.append(engine.add_request(prompt, max_new_tokens=max_new,
                                            stop_ids=(ref[2],)))
        elif i % 3 == 2 and any(t < 128 for t in ref):  # stop at an ASCII character
            added.append(engine.add_request(prompt, max_new_tokens=max_new,
                                            stop=(chr(next(t for t in ref if t < 128)),)))
        else:
            added.append(engine.add_request(prompt, max_new_tokens=max_new))
    for _ in range(3):
        engine.step()
    cancelled = [r for r in added if len(r.tokens) >= 2 and not r.done][:3]
    for request in cancelled:
        engine.cancel(request)
    while engine.has_work:
        engine.step()
    for request, ref in zip(added, refs, strict=True):
        p = request.params
        if request in cancelled:
            assert request.finish_reason == "cancelled"
            assert request.tokens == ref[:len(request.tokens)]
        elif p.stop_ids:
            assert request.tokens == ref[:ref.index(p.stop_ids[0])]
            assert request.finish_reason == "stop"
        elif p.stop:
            cut = ref.index(ord(p.stop[0]))
            assert request.tokens == ref[:cut + 1] and request.finish_reason == "stop"
            assert request.text == enc.decode(ref[:cut])
        else:
            assert request.tokens == ref and request.text == enc.decode(ref)
    assert len(cancelled) == 3 and engine.blocks.in_use() == 0


def test_requests_still_queued_are_cancelled_and_aborted_too(model):
    """A client that goes away may leave requests that never ran (a server's queue)."""
    engine = Engine(model, block_size=4, max_batch=2)
    added = [engine.add_request([1 + i, 2, 3], max_new_tokens=20) for i in range(5)]
    engine.step()
    assert len(engine.running) == 2 and len(engine.waiting) == 3
    for request in added[:4]:
        engine.cancel(request)
    engine.step()
    assert [r.finish_reason for r in added[:4]] == ["cancelled"] * 4
    later = engine.add_request([9, 9, 9], max_new_tokens=20)
    assert engine.abort() == [added[4], later] and later.finish_reason == "error"
    assert not engine.has_work and engine.blocks.in_use() == 0


def test_a_seeded_request_samples_the_same_whatever_else_is_batched(model):
    prompt, settings = [5, 17, 99], dict(max_new_tokens=20, temperature=1.0, top_k=50, seed=7)
    expected = alone(model, prompt, 20, temperature=1.0, top_k=50, seed=7)
    by_itself = Engine(model, block_size=4).generate([prompt], **settings)[0].tokens
    crowd = Engine(model, block_size=4, num_blocks=12, max_batch=4)
    others = [crowd.add_request(p, max_new_tokens=m, temperature=1.0)
              for p, m, _ in random_requests(6, seed=3)]
    mine = crowd.add_request(prompt, **settings)
    while crowd.has_work:
        crowd.step()
    assert by_itself == mine.tokens == expected
    assert all(r.done for r in others)


def test_a_shared_prompt_is_computed_once_and_its_blocks_are_shared(model):
    engine = Engine(model, block_size=4)
    prompt = list(range(30))  # 7 full blocks and 2 tokens
    first = engine.generate([prompt], max_new_tokens=1)[0]
    assert engine.num_prefilled == 30
    samples = [engine.add_request(prompt, max_new_tokens=5, temperature=1.0, seed=s)
               for s in range(4)]
    engine.step()
    assert engine.num_prefilled == 30 + 4 * 2  # the cached 28 tokens are not recomputed
    shared = set(samples[0].table[:7])
    assert all(set(r.table[:7]) == shared for r in samples)
    assert all(engine.blocks.ref_count[b] == 4 for b in shared)
    while engine.has_work:
        engine.step()
    assert first.tokens == alone(model, prompt, 1)
    assert engine.blocks.in_use() == 0


def test_a_continuation_adopts_the_partly_filled_block_and_computes_only_new_tokens(model):
    """A conversation's next turn: its prompt continues an ended request's prompt and reply.
    The full blocks are found by name, and the partly filled last block is adopted, so the
    new prompt computes only what the ended request never did: its last sampled token
    (never fed back) and the new tokens; before, a block's worth more."""
    engine = Engine(model, block_size=4)
    first = engine.generate([list(range(10))], max_new_tokens=5)[0]  # computed: 10 + 4
    assert first.finish_reason == "length"
    follow = first.all_tokens + [7, 8, 9]
    before = engine.num_prefilled
    twins = [engine.add_request(follow, max_new_tokens=6) for _ in range(2)]
    engine.step()
    computed = len(first.prompt) + len(first.tokens) - 1
    # one adopts the block (4 new tokens); the other finds only the 3 full blocks (6)
    assert engine.num_prefilled - before == (len(follow) - computed) + (len(follow) - 12)
    while engine.has_work:
        engine.step()
    assert [r.tokens for r in twins] == [alone(model, follow, 6)] * 2
    assert engine.blocks.in_use() == 0
    other = engine.generate([list(range(10)) + [0, 1, 2]], max_new_tokens=2)[0]  # diverges
    assert other.tokens == alone(model, list(range(10)) + [0, 1, 2], 2)


@pytest.mark.parametrize(("prompt", "settings", "message"), [
    ([], {}, "the prompt is empty"),
    (list(range(CONTEXT + 1)), {}, "never crops a prompt"),
    ([1, 2], {"max_new_tokens": -1}, "max_new_tokens must be an integer >= 0"),
    ([1, 2], {"temperature": -0.5}, "temperature must be"),
    ([1, 2], {"top_p": 1.5}, "top_p must be a number in"),
    ([1, 300], {}, "prompt ids must be in"),
    ([1, 2], {"stop": ("x",)}, "stop strings need the engine's tokenizer"),
])
def test_bad_requests_are_refused_and_the_others_go_on(model, prompt, settings, message):
    engine = Engine(model, block_size=4)
    good = engine.add_request([3, 4, 5], max_new_tokens=6)
    engine.step()
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt, **settings)
    while engine.has_work:
        engine.step()
    assert good.tokens == alone(model, [3, 4, 5], 6)


@pytest.mark.parametrize("settings", [{"max_step_tokens": 0}, {"max_batch": 0}])
def test_an_engine_that_could_not_step_is_refused(model, settings):
    with pytest.raises(ValueError, match="max_step_tokens and max_batch must be >= 1"):
        Engine(model, **settings)


def test_a_request_that_can_never_fit_the_pool_is_refused(model):
    engine = Engine(model, block_size=4, num_blocks=3)
    with pytest.raises(ValueError, match="more than the whole KV pool"):
        engine.add_request([1] * 10, max_new_tokens=10)


@pytest.mark.parametrize(("prompt", "settings", "field"), [
    ([], {}, "prompt"),
    (list(range(CONTEXT + 1)), {}, "prompt"),
    ([1, 300], {}, "prompt"),
    ([1] * 10, {"max_new_tokens": 10}, "max_new_tokens"),  # 5 blocks of 4, the pool has 3
    ([1, 2], {"temperature": -1.0}, "temperature"),
])
def test_a_refusal_names_the_field_at_fault_and_checking_adds_nothing(model, prompt, settings,
                                                                       field):
    """The server answers 400 with the field an engine refusal names (max_tokens for
    max_new_tokens), instead of repeating the engine's checks."""
    engine = Engine(model, block_size=4, num_blocks=3)
    with pytest.raises(RequestError) as err:
        engine.check_request(prompt, SamplingParams(**settings))
    assert err.value.field == field and not engine.has_work
    with pytest.raises(RequestError) as again:
        engine.add_request(prompt, **settings)
    assert again.value.field == field and str(again.value) == str(err.value)
    assert not engine.has_work


def test_requests_added_from_many_threads_while_the_engine_steps(model):
    engine = Engine(model, block_size=4, max_batch=6)
    requests = random_requests(24, seed=4)
    added, lock = [], threading.Lock()

    def client(chunk):
        for prompt, max_new, _ in chunk:
            request = engine.add_request(prompt, max_new_tokens=max_new)
            with lock:
                added.append((prompt, max_new, request))

    threads = [threading.Thread(target=client, args=(requests[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads) or engine.has_work:
        engine.step()
    for t in threads:
        t.join()
    assert len(added) == 24
    for prompt, max_new, request in added:
        assert request.tokens == alone(model, prompt, max_new)


def test_stream_yields_the_tokens_as_they_come(model):
    engine = Engine(model, block_size=4)
    request = engine.add_request([7, 8, 9], SamplingParams(max_new_tokens=12))
    other = engine.add_request([1, 2], max_new_tokens=3)
    assert list(engine.stream(request)) == alone(model, [7, 8, 9], 12) == request.tokens
    assert other.done


def test_with_a_sliding_window_a_request_keeps_only_the_blocks_its_window_sees():
    torch.manual_seed(1)
    cfg = GPTConfig(vocab_size=257, context_length=CONTEXT, emb_dim=32, n_heads=4,
                    n_layers=2, drop_rate=0.0, window_size=8)
    windowed = GPTModel(cfg).double().eval()
    engine = Engine(windowed, block_size=4, max_batch=8)
    requests = sorted(random_requests(30, seed=5), key=lambda r: r[2])
    held = []
    added, step = [], 0
    while len(added) < len(requests) or engine.has_work:
        while len(added) < len(requests) and requests[len(added)][2] <= step:
            prompt, max_new, _ = requests[len(added)]
            added.append(engine.add_request(prompt, max_new_tokens=max_new))
        engine.step()
        held += [sum(b >= 0 for b in r.table) for r in engine.running]
        step += 1
    for (prompt, max_new, _), request in zip(requests, added, strict=True):
        assert request.tokens == alone(windowed, prompt, max_new)
    assert max(held) <= 8 // 4 + 1
    assert engine.blocks.in_use() == 0


def test_logprobs_are_the_models_distribution_at_each_generated_token(model):
    """Each generated token's log-probability and its top candidates, as a full forward
    pass over prompt + tokens so far gives them (temperature 1, before top-k), whatever the
    request sampled with; requests that ask none get none."""
    engine = Engine(model, block_size=4)
    asking = engine.add_request([5, 6, 7], max_new_tokens=6, temperature=0.9, top_k=3,
                                seed=1, logprobs=4)
    quiet = engine.add_request([9, 9], max_new_tokens=4)
    while engine.has_work:
        engine.step()
    assert quiet.logprobs == [] and len(asking.logprobs) == len(asking.tokens) == 6
    ids = torch.tensor([asking.all_tokens])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids)[0].float(), dim=-1)  # (n, vocab)
    for i, (token, (chosen, top)) in enumerate(zip(asking.tokens, asking.logprobs,
                                                      strict=True)):
        row = logp[len(asking.prompt) - 1 + i]
        assert chosen == pytest.approx(row[token].item(), abs=1e-5)
        want = row.topk(4)
        assert [t for t, _ in top] == want.indices.tolist()
        assert [v for _, v in top] == pytest.approx(want.values.tolist(), abs=1e-5)


def test_a_long_prompt_is_prefilled_in_chunks_while_the_others_decode(model):
    """With a budget of 8 tokens a step, a 40-token prompt takes several steps, and the
    request already decoding gains a token at every one of them."""
    engine = Engine(model, block_size=4, max_step_tokens=8)
    decoding = engine.add_request([1, 2, 3], max_new_tokens=20)
    engine.step()
    long_prompt = list(range(100, 140))
    long = engine.add_request(long_prompt, max_new_tokens=5)
    cached, steps = [], 0
    while not long.tokens:
        before = len(decoding.tokens)
        engine.step()
        steps += 1
        assert len(decoding.tokens) == before + 1  # never stalled
        cached.append(long.num_cached)
    assert steps == 6 and cached[:5] == [7, 14, 21, 28, 35]  # 7 a step beside one decode
    while engine.has_work:
        engine.step()
    assert long.tokens == alone(model, long_prompt, 5)
    assert decoding.tokens == alone(model, [1, 2, 3], 20)


def test_a_step_runs_the_model_once_and_samples_once(model, monkeypatch):
    """Prefills of several prompts and the decodes beside them: one forward pass and one
    sampling call per step, whatever the mix."""
    import gptmini.generate.engine.engine as engine_module

    calls = {"forward": 0, "sample": 0}
    real_sample = engine_module.sample

    def counting_sample(*args, **kwargs):
        calls["sample"] += 1
        return real_sample(*args, **kwargs)

    monkeypatch.setattr(engine_module, "sample", counting_sample)
    hook = model.register_forward_hook(lambda *_: calls.__setitem__("forward",
                                                                     calls["forward"] + 1))
    try:
        engine = Engine(model, block_size=4)
        engine.add_request([1, 2, 3], max_new_tokens=8)
        engine.step()
        for prompt in ([4, 5], [6, 7, 8, 9, 10], [11]):  # prefilled beside a decode
            engine.add_request(prompt, max_new_tokens=4)
        steps = 0
        while engine.has_work:
            before = dict(calls)
            engine.step()
            steps += 1
            assert calls["forward"] - before["forward"] == 1
            assert calls["sample"] - before["sample"] == 1
    finally:
        hook.remove()
    assert steps == 7


def test_requests_past_the_context_take_turns_at_a_budget_too_small_for_all(model):
    """Past the context every token recomputes context_length tokens. With a budget of two
    such recomputes a step (and 40 tokens more: a partial one), eight sliding requests each
    gain a token every few steps; none waits for the oldest to finish (issue 29: the oldest
    took the whole budget at every step, and each partial recompute was thrown away)."""
    engine = Engine(model, block_size=4, max_step_tokens=2 * CONTEXT + 40)
    prompts = [[7 + i, 11, 13] for i in range(8)]
    requests = [engine.add_request(p, max_new_tokens=CONTEXT + 40) for p in prompts]
    longest_wait, waited = 0, [0] * 8
    while engine.has_work:
        before = [len(r.tokens) for r in requests]
        engine.step()
        for i, r in enumerate(requests):
            waited[i] = 0 if r.done or len(r.tokens) > before[i] else waited[i] + 1
        longest_wait = max(longest_wait, *waited)
    assert longest_wait <= 3  # 8 recomputes of 48 tokens at 136 a step: a turn in 3 steps
    for prompt, request in zip(prompts, requests, strict=True):
        assert request.tokens == alone(model, prompt, CONTEXT + 40)
