"""How much compute: parameters counted, training FLOPs per token, and a device's peak
FLOP/s, the two halves of model FLOPs utilization (MFU)."""

import functools
import time

import torch
from lightning.fabric.utilities.throughput import get_available_flops
from torch import nn

from gptmini.model import GPTConfig, GPTModel


def num_parameters(model: nn.Module, non_embedding: bool = False) -> int:
    """Parameters counted once (a tied head is not counted twice).

    With `non_embedding`, the token and position embeddings are left out, the count
    scaling laws and FLOP estimates use; an untied output head still counts.
    """
    total = sum(p.numel() for p in model.parameters())
    if non_embedding and isinstance(model, GPTModel):
        if model.cfg.position == "learned":
            total -= model.pos_emb.weight.numel()
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


def peak_flops_of(device: torch.device, dtype: torch.dtype = torch.float32) -> float | None:
    """Peak FLOP/s of one device computing in `dtype`.

    GPUs from Lightning's table, which tells an H100 SXM from a PCIe card and counts TF32
    for float32 when matmuls may use it; a CPU by measuring its matmul rate in `dtype`, once
    per process. None for a device neither knows.
    """
    if device.type == "cpu":
        return measure_matmul_flops(dtype=dtype)
    flops = get_available_flops(device, dtype)
    return float(flops) if flops else None


@functools.cache
def measure_matmul_flops(size: int = 1024, seconds: float = 0.5,
                         dtype: torch.dtype = torch.float32) -> float:
    """The CPU's matmul rate in FLOP/s for `dtype`, measured over about `seconds` (cached)."""
    gen = torch.Generator().manual_seed(0)  # leaves the global generator (dropout) alone
    a, b = (torch.randn(size, size, generator=gen).to(dtype) for _ in range(2))
    a @ b  # warm up threads and caches
    runs, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        a @ b
        runs += 1
    return 2 * size**3 * runs / elapsed
