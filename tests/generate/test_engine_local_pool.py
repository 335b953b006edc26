"""The engine with local and global layers: the windowed layers' own pool and block table.

A model whose `layer_windows` mix windows and global layers keeps the global layers' keys in
the engine's `pool` (a request's `table`) and the windowed layers' in `local_pool` (its
`local_table`), whose blocks behind the widest window go back. The oracle is the plain model
recomputing every step without a cache (`generate(..., use_cache=False)`), in float64 so
that tokens must be identical.
"""

import math

import pytest
import torch
from helpers import random_requests

from gptmini.generate.engine import Engine, block_hash
from gptmini.generate.loop import generate
from gptmini.generate.sampling import RequestError
from gptmini.model import GPTConfig, GPTModel

CONTEXT, WINDOW, BLOCK = 48, 8, 4
HELD = math.ceil(WINDOW / BLOCK) + 1  # local blocks a decoding request may hold


def local_global(layer_windows, seed: int = 0) -> GPTModel:
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=257, context_length=CONTEXT, emb_dim=32, n_heads=4,
                    n_layers=4, drop_rate=0.0, position="rope", layer_windows=layer_windows)
    model = GPTModel(cfg).double().eval()
    with torch.no_grad():  # sharpened, so that a key read from the wrong slot flips a draw
        for weight in model.parameters():
            weight.mul_(4)
    return model


@pytest.fixture(scope="module")
def model():
    # the widest local window (8) is the one the local table keeps
    return local_global([WINDOW, 6, WINDOW, None])


def recomputed(model, prompt, max_new_tokens) -> list[int]:
    """The oracle: every token from a full pass over the (cropped) sequence, no cache."""
    out = generate(model, torch.tensor([prompt]), max_new_tokens, use_cache=False)
    return out[0, len(prompt):].tolist()


def held(table: list[int]) -> int:
    return sum(b >= 0 for b in table)


@pytest.mark.parametrize(("num_blocks", "num_local_blocks", "shared_prefix", "step_tokens"), [
    (None, None, 0, None),
    (None, None, 20, None),  # prefix caching: shared prompts' blocks found in both pools
    (14, None, 20, None),  # preempted for want of global blocks
    (None, 14, 20, None),  # preempted for want of local blocks
    (None, 14, 20, 7),  # and prompts prefilled in chunks of 7
])
def test_requests_get_the_recomputed_tokens_and_local_blocks_stay_within_the_window(
        model, num_blocks, num_local_blocks, shared_prefix, step_tokens):
    """20 staggered requests, prompts longer than the window, some sliding past the context."""
    requests = sorted(random_requests(20, seed=3, shared_prefix=shared_prefix),
                      key=lambda r: r[2])
    engine = Engine(model, block_size=BLOCK, num_blocks=num_blocks, max_batch=8,
                    max_step_tokens=step_tokens, num_local_blocks=num_local_blocks)
    assert engine.local_pool is not None and engine.local_pool.keys.shape[0] == 3
    added, step, decoding_held = [], 0, []
    while len(added) < len(requests) or engine.has_work:
        while len(added) < len(requests) and requests[len(added)][2] <= step:
            prompt, max_new, _ = requests[len(added)]
            added.append(engine.add_request(prompt, max_new_tokens=max_new))
        engine.step()
        for r in engine.running:
            assert len(r.local_table) == len(r.table)
            if r.pending == 1:  # decoding (a prompt holds its blocks until it is computed)
                decoding_held.append(held(r.local_table))
        step += 1
    for (prompt, max_new, _), request in zip(requests, added, strict=True):
        assert request.tokens == recomputed(model, prompt, max_new), request.id
    assert (engine.num_preemptions > 0) == bool(num_blocks or num_local_blocks)
    assert decoding_held and max(decoding_held) <= HELD
    assert engine.blocks.in_use() == 0 and engine.local_blocks.in_use() == 0
    assert engine.local_blocks.num_free == engine.local_blocks.num_blocks


def test_the_global_pool_grows_with_a_sequence_and_the_local_pool_holds_its_window(model):
    engine = Engine(model, block_size=BLOCK)
    everything = Engine(local_global([None] * 4), block_size=BLOCK)  # all global: one pool
    assert everything.local_pool is None
    request = engine.add_request(list(range(20)), max_new_tokens=CONTEXT - 20)
    alike = everything.add_request(list(range(20)), max_new_tokens=CONTEXT - 20)
    global_held, local_held = [], []
    while engine.has_work:
        engine.step()
        everything.step()
        if not request.done:
            global_held.append(held(request.table))
            local_held.append(held(request.local_table))
            assert global_held[-1] == math.ceil(request.num_cached / BLOCK)
            assert held(alike.table) == global_held[-1]
            # the global layer's (1 of 4) blocks grow, the 3 windowed layers' stay put
            per_layer = everything.pool.bytes_per_block // 4
            assert everything.held_bytes == 4 * global_held[-1] * per_layer
            assert engine.held_bytes == (global_held[-1] + 3 * local_held[-1]) * per_layer
    assert global_held[-1] == math.ceil((CONTEXT - 1) / BLOCK)  # the last token is not fed
    assert max(local_held) <= HELD and local_held[-1] < global_held[-1] / 3
    assert request.tokens == recomputed(model, list(range(20)), CONTEXT - 20)


def test_a_prefix_is_reused_only_as_far_as_the_local_pool_still_holds_its_window(model):
    """Found in both pools: only the last token is computed. Once other requests have
    evicted the local pool's cached blocks (the global pool still has them all), the hit
    is cut back and the whole prompt is computed again, with the same tokens."""
    engine = Engine(model, block_size=BLOCK, num_local_blocks=12)
    prompt = list(range(30))  # 7 full blocks and 2 tokens
    want = recomputed(model, prompt, 3)
    assert engine.generate([prompt], max_new_tokens=3)[0].tokens == want
    before = engine.num_prefilled
    assert engine.generate([prompt], max_new_tokens=3)[0].tokens == want
    assert engine.num_prefilled - before == 30 - 28  # the 7 full blocks: found in both
    engine.generate([list(range(100, 140))], max_new_tokens=1)  # 10 new local blocks
    names, parent = [], None
    for i in range(0, 28, BLOCK):  # the 7 full blocks' names: each chained on the last
        parent = block_hash(parent, prompt[i:i + BLOCK])
        names.append(parent)
    assert all(name in engine.blocks.by_name for name in names)  # the global pool has all
    assert not all(name in engine.local_blocks.by_name for name in names[5:])  # not these
    before = engine.num_prefilled
    assert engine.generate([prompt], max_new_tokens=3)[0].tokens == want
    assert engine.num_prefilled - before == 30


def test_a_continuation_adopts_the_partly_filled_block_in_both_pools(model):
    engine = Engine(model, block_size=BLOCK)
    first = engine.generate([list(range(10))], max_new_tokens=5)[0]  # computed: 10 + 4
    follow = first.all_tokens + [7, 8, 9]
    before = engine.num_prefilled
    turn = engine.add_request(follow, max_new_tokens=6)
    engine.step()
    assert engine.num_prefilled - before == len(follow) - (10 + 4)  # only the new tokens
    while engine.has_work:
        engine.step()
    assert turn.tokens == recomputed(model, follow, 6)
    assert engine.blocks.in_use() == 0 and engine.local_blocks.in_use() == 0


def test_the_local_pool_is_sized_checked_and_refused_where_it_has_no_meaning(model):
    engine = Engine(model, block_size=BLOCK, max_batch=4, max_step_tokens=16)
    # 4 windows of 3 blocks, and the context's 12 blocks for prompts being prefilled
    assert engine.local_blocks.num_blocks == 4 * HELD + CONTEXT // BLOCK
    assert engine.local_pool.bytes_per_block == 3 * engine.pool.bytes_per_block
    small = Engine(model, block_size=BLOCK, num_local_blocks=5)
    with pytest.raises(RequestError, match="raise num_local_blocks") as error:
        small.add_request([1, 2, 3], max_new_tokens=30)  # can grow to 33 tokens: 9 blocks
    assert error.value.field == "max_new_tokens"
    assert small.generate([[1, 2, 3]], max_new_tokens=17)[0].tokens == recomputed(
        model, [1, 2, 3], 17)
    for one_pool in ([None] * 4, [WINDOW] * 4):  # all global; all windowed (kv_window)
        with pytest.raises(ValueError, match="num_local_blocks=8 needs a model of local"):
            Engine(local_global(one_pool), num_local_blocks=8)
        assert Engine(local_global(one_pool)).local_pool is None
