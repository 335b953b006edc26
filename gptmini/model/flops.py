"""How much compute a model is: parameters counted, and training FLOPs per token (the model's
half of model FLOPs utilization, MFU; the device's half, its peak FLOP/s, is in
gptmini.runtime)."""

from torch import nn

from gptmini.model.config import GPTConfig
from gptmini.model.gpt import GPTModel


def num_parameters(model: nn.Module, non_embedding: bool = False) -> int:
    """Parameters counted once (a tied head is not counted twice).

    With `non_embedding`, the token and position embeddings are left out, the count
    scaling laws and FLOP estimates use; an untied output head still counts.
    """
    total = sum(p.numel() for p in model.parameters())
    if non_embedding and isinstance(model, GPTModel):
        embedding = model.position_scheme.embedding  # None where positions are not embedded
        if embedding is not None:
            total -= sum(p.numel() for p in embedding.parameters())
        if not model.cfg.tie_weights:
            total -= model.tok_emb.weight.numel()
    return total


def flops_per_token(cfg: GPTConfig, seq_len: int | None = None) -> float:
    """Training FLOPs (forward + backward) per token, the PaLM appendix estimate.

    6 per matmul weight (2 forward, 4 backward), counting the output head whether tied or
    not, plus 12 * n_layers * emb_dim * seq_len for the attention scores and their use.
    """
    seq_len = cfg.context_length if seq_len is None else seq_len
    d, n_layers = cfg.emb_dim, cfg.n_layers
    kv_dim = d // cfg.n_heads * (cfg.n_kv_heads or cfg.n_heads)
    per_layer = d * d + 2 * d * kv_dim + d * d + 8 * d * d  # q, k, v, out_proj, feed-forward
    matmul_weights = n_layers * per_layer + d * cfg.vocab_width
    attention = 12 * n_layers * d * seq_len
    return 6 * matmul_weights + attention
