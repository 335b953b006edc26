"""The block manager: every request's block tables, over one pool of blocks or two.

The scheduler decides who runs; it asks this manager whether there is room and leaves the
books to it, as nano-vllm's scheduler leaves them to its BlockManager. A request holds one
*block table* per pool (`Request.tables`: block i of a table holds its tokens i * block_size
... (i + 1) * block_size - 1 from `Request.start` on), and everything about those tables
happens here:

- **allocation**: a request's blocks for its whole prompt at once (`allocate`), one more
  when its last is full (`append`), all of them back when it ends or is preempted (`free`);
- **prefix caching**: full blocks are named by `block_hash` as they fill (`advance`), and a
  new request reuses the blocks of the longest prefix found by name; the partly filled
  last block of a request that ends is named by its tokens (`partial_hash`) and *adopted*
  by a later request that continues exactly those tokens (a conversation's next turn
  computes only its new tokens);
- **windows**: with a sliding window, blocks wholly behind it go back as a request moves on
  (-1 in its table, a hole that the window mask hides), so a sequence holds about
  window/block_size + 1 of them however long it grows;
- **two pools**: a model of local and global layers (GPTConfig.layer_windows with a global
  layer among windowed ones) keeps its windowed layers' keys in a pool of their own, as
  vLLM's hybrid allocator keeps a block table per group of layers. The global layers' table
  (`table`, pool `blocks`) grows with the sequence; the local one (`local_table`, pool
  `local_blocks`: the same length, block i holding the same tokens) gives back what is
  wholly behind the widest local window. Both tables are allocated together, a request
  fits only when both pools have room, a block of both is named by the same hash, a prefix
  is reused only as far as the local pool still holds the blocks its window needs (those
  before it may be gone: -1), and a partly filled block is adopted only from both pools.
"""

import math

from gptmini.generate.engine.blocks import BlockAllocator, block_hash, partial_hash
from gptmini.generate.engine.request import Request


class BlockManager:
    """The block tables of every request, over `blocks` (and `local_blocks`).

    Args:
        num_blocks, block_size: the pool (of every layer; a local/global model's global
            layers).
        window_size: the sliding window of every layer, or None: blocks wholly behind it go
            back as a request moves on.
        prefix_caching: reuse the blocks of prompts that start the same way.
        local_window, num_local_blocks: with both, a second pool of `num_local_blocks` for
            the windowed layers of a local/global model, whose blocks wholly behind
            `local_window` (the widest local window) go back.
    """

    def __init__(self, num_blocks: int, block_size: int, *, window_size: int | None = None,
                 prefix_caching: bool = True, local_window: int | None = None,
                 num_local_blocks: int | None = None):
        if (local_window is None) != (num_local_blocks is None):
            raise ValueError("give local_window and num_local_blocks together (a local "
                             f"pool), or neither; got {local_window} and {num_local_blocks}")
        self.block_size, self.prefix_caching = block_size, prefix_caching
        self.pools = [BlockAllocator(num_blocks, block_size)]
        self.windows = [window_size]  # each pool's: blocks wholly behind it go back
        if num_local_blocks is not None:
            self.pools.append(BlockAllocator(num_local_blocks, block_size))
            self.windows.append(local_window)

    @property
    def blocks(self) -> BlockAllocator:
        """The pool of every layer (a local/global model's global layers)."""
        return self.pools[0]

    @property
    def local_blocks(self) -> BlockAllocator | None:
        """The windowed layers' pool of a local/global model; None: one pool."""
        return self.pools[1] if len(self.pools) > 1 else None

    def can_allocate(self, num_blocks: int) -> bool:
        """Every pool has `num_blocks` free (or evictable) blocks."""
        return all(num_blocks <= pool.num_free for pool in self.pools)

    def allocate(self, request: Request) -> bool:
        """Tables for all of `request`'s tokens from `request.start` on: the cached blocks of
        its longest known prefix (and an adopted partly filled block after them), the rest
        fresh. `request.num_cached` counts the tokens found. False, holding nothing, when a
        pool is short."""
        tokens = request.all_tokens[request.start:]
        tables = self._cached_prefix(request, tokens)
        needed = math.ceil(len(tokens) / self.block_size) - len(tables[0])
        if not self.can_allocate(needed):
            for pool, table in zip(self.pools, tables, strict=True):
                _release(pool, table)
            return False
        request.num_cached = len(tables[0]) * self.block_size
        adopted = self._adopt_partial(request, tokens)
        if adopted is not None:  # it takes the place of one block allocated below
            for table, block in zip(tables, adopted, strict=True):
                table.append(block)
            needed -= 1
        request.tables = [table + [pool.allocate() for _ in range(needed)]
                          for pool, table in zip(self.pools, tables, strict=True)]
        return True

    def can_append(self, request: Request) -> bool:
        """There is room for `request`'s next token: its last block has a slot, or every
        pool a free block."""
        return not self._full(request) or self.can_allocate(1)

    def append(self, request: Request) -> None:
        """Room for `request`'s next token: one more block in every table when its last is
        full (after `can_append`)."""
        if self._full(request):
            for pool, table in zip(self.pools, request.tables, strict=True):
                table.append(pool.allocate())

    def advance(self, request: Request, num_new: int) -> None:
        """The model wrote `num_new` more of `request`'s tokens into its blocks: blocks it
        filled are named for the prefix cache, and blocks now wholly behind a window go
        back (the next query, position num_cached, sees keys from num_cached + 1 - window
        on)."""
        request.num_cached += num_new
        self._name_full_blocks(request)
        for pool, table, window in zip(self.pools, request.tables, self.windows, strict=True):
            if window is None:
                continue
            for i in range(max(0, request.num_cached + 1 - window) // self.block_size):
                if table[i] >= 0:
                    pool.release(table[i])
                    table[i] = -1

    def free(self, request: Request) -> None:
        """Give all of `request`'s blocks back (named ones stay cached); a partly filled
        last block is named by its tokens, for `allocate` to adopt. It holds none after."""
        if not request.tables:  # a waiting request (never admitted, or preempted) holds none
            return
        size, full = self.block_size, request.num_cached // self.block_size
        name = None
        if (self.prefix_caching and request.num_cached % size
                and len(request.names) == full):
            tokens = request.all_tokens[request.start:][full * size:request.num_cached]
            name = partial_hash(request.names[-1] if request.names else None, tokens)
        for pool, table in zip(self.pools, request.tables, strict=True):
            if name is not None and table[full] >= 0:
                pool.release_partial(table[full], name)
                table[full] = -1
            _release(pool, table)
        request.tables, request.num_cached = [], 0

    # --- prefix caching -----------------------------------------------------------------

    def _cached_prefix(self, request: Request, tokens: list[int]) -> list[list[int]]:
        """Each table's start for the longest cached prefix of `tokens` (each block now
        used once more), its blocks' names in `request.names`: the first pool's blocks of
        the chain of names, cut back to where every other pool still has what its window
        needs. The last token is always computed: its logits pick the next token."""
        hits, names, parent = [], [], None
        size = self.block_size
        for i in range((len(tokens) - 1) // size if self.prefix_caching else 0):
            parent = block_hash(parent, tokens[i * size:(i + 1) * size])
            block = self.blocks.lookup(parent)
            if block is None:
                break
            hits.append(block)
            names.append(parent)
        for k in range(len(hits), -1, -1):  # k = 0 always succeeds: nothing to find
            others = self._windowed_prefix(names[:k])
            if others is not None:
                _release(self.blocks, hits[k:])
                request.names = names[:k]
                return [hits[:k], *others]
        raise AssertionError("unreachable: an empty prefix needs no block")

    def _windowed_prefix(self, names: list[bytes]) -> list[list[int]] | None:
        """The other pools' table starts for full blocks of `names`: -1 behind the window of
        the first token to compute, then their blocks of those names (each now used once
        more); None, holding nothing, when a pool no longer has them all."""
        k, size, starts = len(names), self.block_size, []
        for pool, window in zip(self.pools[1:], self.windows[1:], strict=True):
            first = max(0, k * size + 1 - window) // size
            found = []
            for name in names[first:]:
                block = pool.lookup(name)
                if block is None:
                    break
                found.append(block)
            if len(found) < k - first:
                for held, table in zip(self.pools[1:], [*starts, found], strict=False):
                    _release(held, table)
                return None
            starts.append([-1] * first + found)
        return starts

    def _adopt_partial(self, request: Request, tokens: list[int]) -> list[int] | None:
        """After the cached full blocks: the longest partly filled block an ended request
        left (`BlockAllocator.adopt`) that `tokens` continue, one per pool, its tokens added
        to `request.num_cached`; None when there is none (or a pool no longer has it). The
        last token is always computed."""
        if not self.prefix_caching:
            return None
        size, start = self.block_size, request.num_cached
        parent = request.names[-1] if request.names else None
        for k in range(min(size - 1, len(tokens) - 1 - start), 0, -1):
            name = partial_hash(parent, tokens[start:start + k])
            block = self.blocks.adopt(name)
            if block is None:
                continue
            adopted = [block, *(pool.adopt(name) for pool in self.pools[1:])]
            if None in adopted:  # the windowed layers' half is gone: compute it
                for pool, taken in zip(self.pools, adopted, strict=True):
                    if taken is not None:
                        pool.release(taken)
                return None
            request.num_cached += k
            return adopted
        return None

    def _name_full_blocks(self, request: Request) -> None:
        if not self.prefix_caching:
            return
        size, tokens = self.block_size, request.all_tokens[request.start:]
        for i in range(len(request.names), request.num_cached // size):
            parent = request.names[-1] if request.names else None
            name = block_hash(parent, tokens[i * size:(i + 1) * size])
            for pool, table in zip(self.pools, request.tables, strict=True):
                if table[i] >= 0:  # (-1: dropped behind the window already)
                    table[i] = pool.register(table[i], name)
            request.names.append(name)

    def _full(self, request: Request) -> bool:
        """Every slot of `request`'s blocks holds a token."""
        return request.num_cached == len(request.tables[0]) * self.block_size


def _release(pool: BlockAllocator, table: list[int]) -> None:
    for block in table:
        if block >= 0:  # -1: dropped behind the window already
            pool.release(block)
