"""The block allocator of a paged KV cache: blocks handed out, shared, cached and freed.

Seed 003's paged attention cuts the KV cache into fixed-size blocks (pages). A sequence
holds a *block table*, the list of its blocks in order; block `i` of the table holds the
keys and values of the sequence's tokens `i * block_size ... (i + 1) * block_size - 1`.
Memory is handed out one block at a time as a sequence grows, and given back when it ends,
so no sequence reserves room for a length it may never reach.

Prefix caching: a *full* block is named by a hash of its token ids and of every token
before it (the hash of the previous block chained in), which is exactly what its keys and
values depend on. A new sequence whose first blocks have the same names reuses them, read
only, instead of computing them again: `n` samples of one prompt, or many requests behind
one system prompt, share those blocks. Each block counts the sequences using it; at zero a
named block stays cached (and can be found again) until its memory is needed.

A sequence that ends leaves its last block partly filled; that block is named too
(`partial_hash`: its tokens so far), so that a later sequence continuing those very tokens,
a conversation's next turn, can *adopt* it (`adopt`): it becomes that sequence's own block,
unnamed, and is filled on from where it was left. Only an unused one is adopted, so no
two sequences ever write into one block.
"""

import hashlib
from collections import OrderedDict
from collections.abc import Sequence


def block_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """The name of a full block: its tokens and, through `parent`, all tokens before."""
    digest = hashlib.blake2b(parent or b"", digest_size=16)
    digest.update(b",".join(str(t).encode() for t in tokens))
    return digest.digest()


def partial_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """The name of a block holding only `tokens` (fewer than a block), after `parent`: never
    a full block's name (the count is hashed in)."""
    return block_hash(parent, [-len(tokens), *tokens])


class BlockAllocator:
    """`num_blocks` blocks of `block_size` tokens, with reference counts and a prefix cache.

    Blocks with a count of zero are free; those among them with a name are also kept in
    `cached` (oldest first), so a later sequence can take them back with their contents,
    until `allocate` needs their memory and evicts the oldest.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and "
                             f"{block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref_count = [0] * num_blocks
        self.name: list[bytes | None] = [None] * num_blocks
        self.by_name: dict[bytes, int] = {}
        self.cached: OrderedDict[int, None] = OrderedDict()  # free, named, oldest first
        self.free = list(range(num_blocks - 1, -1, -1))  # free, unnamed: a stack

    @property
    def num_free(self) -> int:
        """Blocks `allocate` can hand out now (unnamed free ones and evictable cached ones)."""
        return len(self.free) + len(self.cached)

    def allocate(self) -> int:
        """A block for one sequence (count 1), its old contents forgotten.

        Raises:
            MemoryError: every block is in use (the engine preempts before this happens).
        """
        if self.free:
            block = self.free.pop()
        elif self.cached:
            block, _ = self.cached.popitem(last=False)  # evict the oldest cached block
            del self.by_name[self.name[block]]
            self.name[block] = None
        else:
            raise MemoryError("no free KV block")
        self.ref_count[block] = 1
        return block

    def lookup(self, name: bytes) -> int | None:
        """The block named `name`, now also used by the caller (count + 1), or None."""
        block = self.by_name.get(name)
        if block is not None:
            self.cached.pop(block, None)  # in use again: not evictable
            self.ref_count[block] += 1
        return block

    def register(self, block: int, name: bytes) -> int:
        """Name a block the caller just filled; if another block already has the name, the
        caller gets that one instead (its own is released) and should use what is returned."""
        existing = self.by_name.get(name)
        if existing is not None and existing != block:
            self.release(block)
            return self.lookup(name)
        self.name[block], self.by_name[name] = name, block
        return block

    def adopt(self, name: bytes) -> int | None:
        """The unused block named `name` (a sequence's partly filled last block), now the
        caller's alone and unnamed (count 1), or None: no such block, or one in use."""
        block = self.by_name.get(name)
        if block is None or self.ref_count[block] > 0:
            return None
        del self.cached[block], self.by_name[name]
        self.name[block], self.ref_count[block] = None, 1
        return block

    def release_partial(self, block: int, name: bytes) -> None:
        """`release` a sequence's partly filled last block, named `name` so that `adopt` can
        find it, unless another block already has that name or others use this one."""
        if self.ref_count[block] == 1 and self.name[block] is None and name not in self.by_name:
            self.name[block], self.by_name[name] = name, block
        self.release(block)

    def release(self, block: int) -> None:
        """One sequence stops using `block`; at zero it is free (and cached, if named)."""
        if self.ref_count[block] <= 0:
            raise RuntimeError(f"block {block} released more often than it was taken")
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            if self.name[block] is not None:
                self.cached[block] = None
            else:
                self.free.append(block)

    def in_use(self) -> int:
        return sum(1 for c in self.ref_count if c > 0)
