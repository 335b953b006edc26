"""How much compute a model is: parameters counted, and training FLOPs per token (the model's
half of model FLOPs utilization, MFU; the device's half, its peak FLOP/s, is in
gptmini.runtime).

Letters in the formulas:
    d        emb_dim
    T        seq_len, the tokens a training window attends over
    H        n_heads
    N        a layer's matmul weights (every nn.Linear's, the convolution's)

The count is the PaLM appendix's (nanoGPT's): a matmul weight costs 2 FLOPs per token
forward and 4 backward (the gradients of its input and of itself), 6 in all, and whatever
multiplies activations by activations (attention scores, their use, a linear-attention
state) costs 3 times its forward FLOPs. Norms, softmaxes, rotations and other elementwise
work are left out, as the estimate always has. Attention is counted over all T keys, as the
kernels compute the masked scores too (no halving for causality or a window). Each layer
is counted as what it is: its token mixer and its feed-forward each say their own FLOPs
(`TokenMixer.flops_per_token`, `FeedForwardKind.flops_per_token`), so multi-head latent
attention and Gated DeltaNet layers are their own FLOPs, not plain attention's.
"""

from torch import nn

from gptmini.model.config import GPTConfig
from gptmini.model.gpt import GPTModel

__all__ = ["flops_per_token", "layer_flops_per_token", "num_parameters"]


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
    """Training FLOPs (forward + backward) per token: every layer's
    (`layer_flops_per_token`) plus 6 * d * vocab for the output head, counted whether it
    is tied to the embedding or not (the matmul runs either way).

    For the book's model this is 6N + 12 * n_layers * d * T, N the matmul weights with the
    head: the PaLM appendix estimate.
    """
    seq_len = cfg.context_length if seq_len is None else seq_len
    mixers, feed_forward = cfg.mixers(), cfg.feed_forward()
    layers = sum(mixer.flops_per_token(i, seq_len) + feed_forward.flops_per_token()
                 for i, mixer in enumerate(mixers))
    return layers + 6 * cfg.emb_dim * cfg.vocab_width


def layer_flops_per_token(cfg: GPTConfig, layer: int, seq_len: int | None = None) -> float:
    """Training FLOPs per token of layer `layer` (0 first): its token mixer's and its
    feed-forward's, as each counts itself (for the book's: 6 * N for attention's four d x d
    weights plus 12 * T * d for its scores and their use, and 6 * N for the MLP's 2 * d *
    hidden weights, 3 * d * hidden for SwiGLU's gate, up and down projections)."""
    seq_len = cfg.context_length if seq_len is None else seq_len
    return (cfg.mixers()[layer].flops_per_token(layer, seq_len)
            + cfg.feed_forward().flops_per_token())
