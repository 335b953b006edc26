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
is counted as what it is (`layer_flops_per_token`), so multi-head latent attention and
Gated DeltaNet layers are their own FLOPs, not plain attention's.
"""

import math

from torch import nn

from gptmini.attention.deltanet import CHUNK_SIZE, CONV_KERNEL
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
    layers = sum(layer_flops_per_token(cfg, i, seq_len) for i in range(cfg.n_layers))
    return layers + 6 * cfg.emb_dim * cfg.vocab_width


def layer_flops_per_token(cfg: GPTConfig, layer: int, seq_len: int | None = None) -> float:
    """Training FLOPs per token of layer `layer` (0 first): its token mixer, as
    GPTConfig.layer_kind and the mla_* fields make it, and its MLP (6 * N: 2 * d * hidden
    weights, 3 * d * hidden for SwiGLU's gate, up and down projections)."""
    seq_len = cfg.context_length if seq_len is None else seq_len
    if cfg.layer_kind(layer) == "deltanet":
        mixer = _deltanet_flops(cfg, seq_len)
    elif cfg.mla_kv_lora_rank is not None:
        mixer = _latent_attention_flops(cfg, seq_len)
    else:
        mixer = _attention_flops(cfg, seq_len)
    mlp_weights = (3 if cfg.mlp == "swiglu" else 2) * cfg.emb_dim * cfg.hidden_dim
    return mixer + 6 * mlp_weights


def _attention_flops(cfg: GPTConfig, seq_len: int) -> float:
    """The book's attention (with GQA, a gate): 6 * N for W_query (d x d), W_key and W_value
    (d x kv_dim each), out_proj (d x d) and the gate's W_gate (d x d elementwise, d x H
    headwise); then per token, each of H heads scores T keys (2 * T * head_dim) and mixes
    T values (2 * T * head_dim) forward: 4 * T * d, times 3 = 12 * T * d."""
    d = cfg.emb_dim
    kv_dim = d // cfg.n_heads * (cfg.n_kv_heads or cfg.n_heads)
    gate = {"none": 0, "headwise": cfg.n_heads, "elementwise": d}[cfg.attn_gate]
    weights = d * d + 2 * d * kv_dim + d * d + d * gate
    return 6 * weights + 12 * seq_len * d


def _latent_attention_flops(cfg: GPTConfig, seq_len: int) -> float:
    """Multi-head latent attention (gptmini.attention.latent) as training runs it, the plain
    path (the absorbed one is for decoding). Matmul weights, with r = kv_lora_rank,
    qk = qk_nope_head_dim + qk_rope_head_dim, v = v_head_dim:

        query       d x (H * qk), or through its latent: d x q_lora_rank + q_lora_rank x (H * qk)
        kv_a        d x (r + qk_rope_head_dim): the latent and the shared rotary key
        kv_b        r x (H * (qk_nope_head_dim + v)): every token's latent up-projected once
        out_proj    (H * v) x d

    Scores over queries and keys qk wide (2 * T * H * qk forward) and values v wide
    (2 * T * H * v): 6 * T * H * (qk + v) with backward, 12 * T * d when qk = v = d / H."""
    d, heads, dims = cfg.emb_dim, cfg.n_heads, cfg.mla_dims
    rank, rope, v = dims["kv_lora_rank"], dims["qk_rope_head_dim"], dims["v_head_dim"]
    qk = dims["qk_nope_head_dim"] + rope
    q_rank = dims["q_lora_rank"]
    query = d * heads * qk if q_rank is None else d * q_rank + q_rank * heads * qk
    weights = (query + d * (rank + rope) + rank * heads * (dims["qk_nope_head_dim"] + v)
               + heads * v * d)
    return 6 * weights + 6 * seq_len * heads * (qk + v)


def _deltanet_flops(cfg: GPTConfig, seq_len: int) -> float:
    """A Gated DeltaNet layer (gptmini.attention.deltanet) as a DeltaNetBlock builds it: H
    heads, k = v = head_dim = d / H, conv kernel K, chunks of C tokens.

    Matmul weights: W_query, W_key, W_value, W_gate (d x d each), W_beta and W_decay
    (d x H each), out_proj (d x d), and the depthwise convolution's K weights for each of
    its 3 * d channels (2 * K FLOPs per channel and token forward, like a matmul weight).

    The state update runs chunked in training (`chunked_delta_rule`). Per chunk and head,
    forward: K_beta K^T and Q K^T (2 * C^2 * k each), two unit-triangular solves of C rows
    for k and v right-hand columns (C^2 * (k + v), the BLAS trsm count), scores @ U
    (2 * C^2 * v), and against the state U_per_state @ S, Q_decayed @ S and K_to_end^T @ U
    (2 * C * k * v each). Per token: C * (5k + 3v) + 6 * k * v forward, times 3. A last
    partial chunk is padded to C tokens and computed whole, so T is counted up to a
    multiple of C. (Decoding runs the recurrent form instead: about 4 * k * v per head and
    token, reading and writing the state; it is not training and not counted here.)
    """
    d, heads = cfg.emb_dim, cfg.n_heads
    k = v = d // heads
    weights = 5 * d * d + 2 * d * heads + 3 * d * CONV_KERNEL
    chunks = math.ceil(seq_len / CHUNK_SIZE)
    per_chunk = heads * (CHUNK_SIZE ** 2 * (5 * k + 3 * v) + 6 * CHUNK_SIZE * k * v)
    return 6 * weights + 3 * chunks * per_chunk / seq_len
