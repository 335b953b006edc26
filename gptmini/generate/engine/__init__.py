"""Paged attention and continuous batching: generate for many requests at once.

`Engine` (engine.py) takes requests (request.py) at any time and steps them together over
a paged KV cache: the `Scheduler` (scheduler.py) decides who runs and what each step
computes, asking the `BlockManager` (block_manager.py), which keeps every request's block
tables (prefix caching, windows, a local/global model's two pools) over the pools that
`BlockAllocator` (blocks.py) hands out with reference counts and a prefix cache; the
`ModelRunner` (runner.py) packs a step's tokens in one row (`PackedRow`, packed.py) and runs
the model once, over `KVPool` (paged.py), which holds the blocks' keys and values and shows
them to the model as ordinary caches.

    engine = Engine(model, tokenizer)
    done = engine.generate([tokenizer.encode("ROMEO:"), ...], max_new_tokens=50)
"""

from gptmini.generate.engine.block_manager import BlockManager
from gptmini.generate.engine.blocks import BlockAllocator, block_hash
from gptmini.generate.engine.engine import Engine
from gptmini.generate.engine.packed import PackedRow
from gptmini.generate.engine.paged import KVPool, PagedView
from gptmini.generate.engine.request import Request
from gptmini.generate.engine.runner import ModelRunner
from gptmini.generate.engine.scheduler import Chunk, Scheduler
from gptmini.generate.sampling import Detokenizer, SamplingParams

__all__ = ["BlockAllocator", "BlockManager", "Chunk", "Detokenizer", "Engine", "KVPool",
           "ModelRunner", "PackedRow", "PagedView", "Request", "SamplingParams", "Scheduler",
           "block_hash"]
