"""What a position scheme is: the three ways a token's place can enter a model, each a
method that does nothing until a scheme overrides it, and whether the scheme is relative."""

from typing import ClassVar, Protocol

import torch
from torch import Tensor, nn

from gptmini.attention.masks import ScoreMod

__all__ = ["ModelShape", "PositionScheme"]


class ModelShape(Protocol):
    """The sizes a scheme is built for (`GPTConfig` is one; attention imports no model)."""

    emb_dim: int
    n_heads: int
    head_size: int
    context_length: int
    rope_theta: float
    rope_scaling: dict | None
    rope_local_theta: float | None


class PositionScheme:
    """How a token's place enters the model; this base adds nothing anywhere.

    A scheme is built once, from the model's shape (`from_config`), checking its own
    constraints as it is built; `GPTModel` then hands the same object to every layer. It
    acts in up to three places, each a method here that leaves its input as it is:

        make_embedding   a module added to the token embeddings (the book's learned one)
        rotate           queries and keys turned by their positions (rotary)
        score_mod        a modifier of attention scores (ALiBi's distance penalty)

    and `relative` says whether positions enter only as distances between a query and a
    key, so that generation may slide a KV cache past the context instead of recomputing
    it. Write a scheme as a dataclass of its parameters (frozen unless it keeps a module),
    so that two alike compare equal: a layer refuses a context built with another scheme.
    """

    relative: ClassVar[bool] = True
    """Positions enter attention only as distances (a query's place minus a key's)."""
    options: ClassVar[tuple[str, ...]] = ()
    """The config's fields of its own that it reads (a config refuses any set without it)."""
    embedding: nn.Module | None = None
    """The module `make_embedding` made (a scheme that embeds keeps it), or None."""

    @classmethod
    def from_config(cls, cfg: ModelShape) -> "PositionScheme":
        """This scheme for a model of `cfg`'s shape; a scheme without parameters takes none."""
        return cls()

    def make_embedding(self) -> nn.Module | None:
        """A new module of position embeddings, or None for none. `GPTModel` calls it once
        and holds the module as `pos_emb` (the book's name, which its state dicts use)."""
        return None

    def embed(self, x: Tensor, context) -> Tensor:
        """x (b, num_tokens, emb_dim), the token embeddings, with positions added."""
        return x

    def rotate(self, queries: Tensor, keys: Tensor, context) -> tuple[Tensor, Tensor]:
        """Queries (b, num_heads, num_tokens, head_dim) and keys (b, num_kv_heads,
        num_tokens, head_dim) at the context's positions, before keys are cached."""
        return queries, keys

    def score_mod(self, device: torch.device | str | None) -> ScoreMod | None:
        """A score modifier (gptmini.attention.masks) for one forward pass, or None."""
        return None
