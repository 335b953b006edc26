"""The book's positions: a learned embedding of each position, added to the token's
embedding before the first block; attention itself sees no positions."""

from dataclasses import dataclass, field

from torch import Tensor, nn

from gptmini.attention.positions.base import ModelShape, PositionScheme

__all__ = ["LearnedPositions"]


@dataclass
class LearnedPositions(PositionScheme):
    """One learned vector per position, up to context_length. Not frozen: it keeps the
    embedding it made, which `embed` adds."""

    relative = False  # each position has its own vector: a token's place counts, not distances

    context_length: int
    emb_dim: int
    embedding: nn.Embedding | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def from_config(cls, cfg: ModelShape) -> "LearnedPositions":
        return cls(context_length=cfg.context_length, emb_dim=cfg.emb_dim)

    def make_embedding(self) -> nn.Embedding:
        self.embedding = nn.Embedding(self.context_length, self.emb_dim)
        return self.embedding

    def embed(self, x: Tensor, context) -> Tensor:
        positions = context.positions  # (b, num_tokens)
        if context.rows_alike:
            positions = positions[:1]  # one lookup broadcast over the batch, as the book's
        return x + self.embedding(positions)  # each token's embedding plus its position's
