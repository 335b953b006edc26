"""The block manager on its own: allocation, freeing, prefix hits, adoption, windows, two
pools, through its public methods and the requests' tables (no model).

The oracle is what a block table means: block i of a table holds tokens i * BLOCK ...
(i + 1) * BLOCK - 1; a block is shared only by requests whose tokens up to its end agree;
a block wholly behind a window (its last token before num_cached + 1 - window) is not held.
"""

import math

import pytest

from gptmini.generate.engine import BlockManager, Request, SamplingParams

BLOCK = 4


def request(tokens: list[int], id: int = 0) -> Request:
    return Request(id, list(tokens), SamplingParams())


def admitted(manager: BlockManager, tokens: list[int], id: int = 0) -> Request:
    """A request given its tables, and its tokens written (as a step's `advance`)."""
    r = request(tokens, id)
    assert manager.allocate(r)
    manager.advance(r, len(tokens) - r.num_cached)
    return r


def two_pools(num_blocks: int = 16, num_local_blocks: int = 16) -> BlockManager:
    return BlockManager(num_blocks, BLOCK, local_window=6, num_local_blocks=num_local_blocks)


def test_a_request_gets_a_block_per_block_size_tokens_and_gives_them_back():
    manager = BlockManager(8, BLOCK, prefix_caching=False)
    r = request(list(range(10)))
    assert manager.allocate(r)
    assert len(r.table) == math.ceil(10 / BLOCK) and len(set(r.table)) == 3
    assert r.num_cached == 0 and r.local_table == [] and manager.local_blocks is None
    assert manager.blocks.in_use() == 3 and manager.blocks.num_free == 5
    manager.advance(r, 10)
    assert r.num_cached == 10
    manager.free(r)
    assert r.table == [] and r.num_cached == 0
    assert manager.blocks.in_use() == 0 and manager.blocks.num_free == 8


def test_a_request_that_does_not_fit_is_refused_holding_nothing():
    manager = BlockManager(4, BLOCK)
    first = admitted(manager, list(range(9)))  # 3 blocks
    second = request(list(range(100, 109)), id=1)  # needs 3, 1 is free
    assert not manager.can_allocate(3) and manager.can_allocate(1)
    assert not manager.allocate(second)
    assert second.table == [] and manager.blocks.in_use() == 3
    manager.free(first)
    assert manager.allocate(second) and manager.blocks.in_use() == 3


def test_freeing_a_request_that_holds_nothing_changes_nothing():
    """A cancelled request may never have been admitted, or may wait after a refusal."""
    manager = two_pools(num_blocks=4, num_local_blocks=4)
    running = admitted(manager, list(range(6)))
    refused = request(list(range(100, 120)), id=1)
    assert not manager.allocate(refused)
    for waiting in (refused, request([1, 2, 3], id=2)):
        manager.free(waiting)
        assert waiting.tables == [] and waiting.num_cached == 0
    assert manager.blocks.in_use() == 2 and manager.local_blocks.in_use() == 2
    manager.free(running)
    manager.free(running)  # twice: nothing more goes back
    assert manager.blocks.in_use() == 0 and manager.local_blocks.in_use() == 0


def test_a_full_last_block_gets_one_more_only_when_there_is_room():
    manager = BlockManager(2, BLOCK, prefix_caching=False)
    r = admitted(manager, list(range(3)))
    other = admitted(manager, [7], id=1)  # takes the last free block
    assert manager.can_append(r)  # its 4th slot is free: no block needed
    manager.append(r)
    assert len(r.table) == 1
    r.tokens.append(3)
    manager.advance(r, 1)  # the block is full now, and the pool has none
    assert not manager.can_append(r)
    manager.free(other)
    assert manager.can_append(r)
    manager.append(r)
    assert len(r.table) == 2 and manager.blocks.in_use() == 2


def test_requests_that_start_alike_share_their_full_blocks_by_name():
    manager = BlockManager(16, BLOCK)
    prompt = list(range(10))
    first = admitted(manager, prompt)
    second = request(prompt[:8] + [50, 51, 52], id=1)
    assert manager.allocate(second)
    assert second.num_cached == 8 and second.table[:2] == first.table[:2]
    assert second.table[2] != first.table[2]  # its tokens 8.. differ
    assert all(manager.blocks.ref_count[b] == 2 for b in first.table[:2])
    # the last token is always computed: a prompt of exactly two blocks finds only one
    exact = request(prompt[:8], id=2)
    assert manager.allocate(exact) and exact.num_cached == BLOCK
    for r in (first, second, exact):
        manager.free(r)
    assert manager.blocks.in_use() == 0


def test_a_freed_requests_named_blocks_are_found_again_until_their_memory_is_needed():
    manager = BlockManager(3, BLOCK)
    prompt = list(range(9))
    first = admitted(manager, prompt)
    blocks = first.table[:2]
    manager.free(first)
    again = request(prompt, id=1)
    assert manager.allocate(again) and again.table[:2] == blocks and again.num_cached >= 8
    manager.free(again)
    evicting = admitted(manager, list(range(100, 112)), id=2)  # all 3 blocks
    manager.free(evicting)
    late = request(prompt, id=3)
    assert manager.allocate(late) and late.num_cached == 0  # evicted: computed again


def test_a_continuation_adopts_the_partly_filled_last_block_of_an_ended_request():
    manager = BlockManager(8, BLOCK)
    turn = list(range(10))  # 2 full blocks and 2 tokens in the third
    first = admitted(manager, turn)
    partial = first.table[2]
    manager.free(first)
    following = request(turn + [60, 61, 62], id=1)
    assert manager.allocate(following)
    assert following.num_cached == 10  # the 2 tokens of the partly filled block too
    assert following.table[2] == partial and manager.blocks.ref_count[partial] == 1
    # it is this request's own now: another continuation computes those 2 tokens again
    other = request(turn + [70], id=2)
    assert manager.allocate(other) and other.num_cached == 8
    assert other.table[2] != partial


def test_without_prefix_caching_nothing_is_found_or_adopted():
    manager = BlockManager(8, BLOCK, prefix_caching=False)
    first = admitted(manager, list(range(10)))
    manager.free(first)
    again = request(list(range(12)), id=1)
    assert manager.allocate(again) and again.num_cached == 0 and again.names == []


@pytest.mark.parametrize("window", [1, 4, 6])
def test_blocks_wholly_behind_the_window_go_back(window):
    manager = BlockManager(16, BLOCK, window_size=window)
    r = admitted(manager, [1, 2])
    for n in range(3, 30):
        r.tokens.append(n)
        assert manager.can_append(r)
        manager.append(r)
        manager.advance(r, 1)
        first_seen = r.num_cached + 1 - window  # the next query's first key
        expected = [(i + 1) * BLOCK <= first_seen for i in range(len(r.table))]
        assert [b < 0 for b in r.table] == expected
        assert manager.blocks.in_use() == expected.count(False)
    manager.free(r)
    assert manager.blocks.in_use() == 0


def test_two_pools_allocate_together_and_the_local_one_keeps_only_its_window():
    manager = two_pools()
    r = admitted(manager, list(range(17)))
    assert len(r.table) == len(r.local_table) == 5
    assert all(b >= 0 for b in r.table)  # the global layers keep every block
    # the next query (17) sees keys 12..: local blocks 0-2 (tokens 0-11) are back
    assert [b < 0 for b in r.local_table] == [True] * 3 + [False] * 2
    assert manager.blocks.in_use() == 5 and manager.local_blocks.in_use() == 2
    manager.free(r)
    assert manager.blocks.in_use() == 0 and manager.local_blocks.in_use() == 0
    with pytest.raises(ValueError, match="local_window and num_local_blocks together"):
        BlockManager(4, BLOCK, local_window=6)


def test_either_pool_short_refuses_a_request_and_stops_a_decode():
    manager = two_pools(num_blocks=16, num_local_blocks=3)
    assert not manager.allocate(request(list(range(13))))  # 4 local blocks needed
    assert manager.blocks.in_use() == 0 and manager.local_blocks.in_use() == 0
    r = admitted(manager, list(range(4)))
    other = admitted(manager, list(range(100, 108)), id=1)  # the last 2 local blocks
    assert manager.blocks.num_free > 1 and manager.local_blocks.num_free == 0
    assert not manager.can_append(r)  # full, and the local pool has no block
    manager.free(other)
    assert manager.can_append(r)
    manager.append(r)
    assert len(r.table) == len(r.local_table) == 2


def test_a_prefix_is_reused_only_as_far_as_the_local_pool_holds_its_window():
    manager = two_pools(num_blocks=16, num_local_blocks=8)
    prompt = list(range(17))
    manager.free(admitted(manager, prompt))
    # the local pool still has what the window of token 16 needs (keys 11..: blocks 2-3):
    # all 4 full blocks are found, the first two as holes, and the 17th token adopted
    whole = request(prompt + [90, 91, 92], id=1)
    assert manager.allocate(whole) and whole.num_cached == 17
    assert whole.local_table[:2] == [-1, -1] and all(b >= 0 for b in whole.local_table[2:])
    assert manager.local_blocks.in_use() == 3
    manager.free(whole)
    # a running request holds blocks 0-1 in both pools; every other local block is evicted
    holder = admitted(manager, prompt[:8], id=2)
    taken = [manager.local_blocks.allocate() for _ in range(manager.local_blocks.num_free)]
    for block in taken:
        manager.local_blocks.release(block)
    # 3 blocks would need local blocks 1-2 (the window of token 12), and block 2 is gone:
    # the prefix is cut back to 2 blocks, which need blocks 0-1 (the window of token 8)
    shorter = request(prompt[:12] + [95], id=3)
    assert manager.allocate(shorter) and shorter.num_cached == 8
    assert shorter.table[:2] == holder.table[:2]
    assert shorter.local_table[:2] == holder.local_table[:2]
    assert manager.blocks.in_use() == 4  # blocks 0-1 shared, 2 fresh: block 2's went back
    for r in (holder, shorter):
        manager.free(r)
    assert manager.blocks.in_use() == 0 and manager.local_blocks.in_use() == 0


def test_a_partly_filled_block_is_adopted_only_while_both_pools_have_it():
    manager = two_pools(num_blocks=16, num_local_blocks=8)
    turn = list(range(6))  # 1 full block and 2 tokens in the second
    manager.free(admitted(manager, turn))
    holder = admitted(manager, turn[:4] + [80], id=1)  # keeps block 0 in both pools
    taken = [manager.local_blocks.allocate() for _ in range(manager.local_blocks.num_free)]
    for block in taken:  # every other local block evicted: the partly filled one too
        manager.local_blocks.release(block)
    following = request(turn + [60, 61], id=2)
    assert manager.allocate(following)
    assert following.num_cached == BLOCK  # the 2 tokens are computed again
    assert following.table[0] == holder.table[0]
    # the global pool's partly filled block went back, not held by anyone
    assert manager.blocks.in_use() == 3 and manager.local_blocks.in_use() == 3
