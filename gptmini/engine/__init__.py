"""Paged attention and continuous batching: generate for many requests at once.

`Engine` (engine.py) takes requests (request.py) at any time and steps them together over
a paged KV cache: `BlockAllocator` (blocks.py) hands out fixed-size blocks with reference
counts and a prefix cache, and `KVPool` (paged.py) holds their keys and values and shows
them to the model as ordinary caches.

    engine = Engine(model, tokenizer)
    done = engine.generate([tokenizer.encode("ROMEO:"), ...], max_new_tokens=50)
"""

from gptmini.engine.blocks import BlockAllocator, block_hash
from gptmini.engine.engine import Engine
from gptmini.engine.paged import KVPool, PagedView
from gptmini.engine.request import Request
from gptmini.sampling import Detokenizer, SamplingParams

__all__ = ["BlockAllocator", "Detokenizer", "Engine", "KVPool", "PagedView", "Request",
           "SamplingParams", "block_hash"]
