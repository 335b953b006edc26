"""Flash attention from scratch, in plain PyTorch: seed 003's tiling and online softmax.

Attention over n tokens forms an (n, n) matrix of scores. The explicit path keeps it, its
softmax and their gradients, so its memory grows as n². FlashAttention (Dao et al., 2022)
never forms it. It cuts queries and keys into tiles and walks them:

    for each tile of queries Q_i:
        m = -inf; l = 0; acc = 0                  # running max, running sum, running output
        for each tile of keys K_j, V_j the mask lets Q_i see:
            S = Q_i K_jᵀ / sqrt(d)                # one tile of scores
            m_new = max(m, rowmax(S))
            P = exp(S - m_new)                    # safe: nothing above 0 is exponentiated
            c = exp(m - m_new)                    # what was summed before, rescaled
            l = l * c + rowsum(P)
            acc = acc * c + P V_j
            m = m_new
        O_i = acc / l                             # exactly softmax(Q_i Kᵀ / sqrt(d)) V
        L_i = m + log(l)                          # the log-sum-exp, all backward keeps

This "online softmax" gives the same numbers as a softmax over the whole row, one tile at a
time. Tiles the mask hides entirely are skipped (about half under a causal mask), tiles it
allows entirely are computed without it, and only tiles on its border evaluate it. The
backward pass stores nothing of size n² either: it recomputes each tile's P from Q, K and L
and accumulates dQ, dK and dV tile by tile, so memory grows linearly with n.

On a GPU the point of tiling is that a tile fits on-chip memory; here, in PyTorch, it is the
algorithm made readable, exact and memory-linear, not a fast kernel. It stays out of
torch.compile, which would unroll its loops. `TiledKernel` (the `tiled` backend) calls it
with the context's tile plan.
"""

import torch
from torch import Tensor

from gptmini.attention.masks import MaskMod, ScoreMod, apply_score_mod, index_grids

__all__ = ["TiledKernel", "tile_plan", "tiled_attention"]


@torch.compiler.disable
def tiled_attention(q: Tensor, k: Tensor, v: Tensor, mask: MaskMod | None = None, *,
                    tile: int = 256, skip_tiles: bool = True,
                    plan: tuple[Tensor, Tensor] | None = None,
                    score_mod: ScoreMod | None = None, sinks: Tensor | None = None) -> Tensor:
    """softmax(q kᵀ / sqrt(head_dim), masked) v, one tile of queries and keys at a time.

    Args:
        q: (b, num_heads, num_tokens, head_dim).
        k, v: (b, num_heads, num_keys, head_dim): repeat key/value heads for grouped-query
            attention first. The queries are the last num_tokens of the num_keys positions.
        mask: (b, h, q_idx, kv_idx) -> bool, True where a query may attend
            (gptmini.attention.masks); None: everything.
        tile: queries and keys per tile.
        skip_tiles: skip the tiles the mask hides entirely; False computes them, masked,
            which changes nothing but the time.
        plan: `tile_plan(mask, ...)` for these shapes and this tile, if already made
            (once per forward pass for every layer: `TiledKernel`); None: made here.
        score_mod: (score, b, h, q_idx, kv_idx) -> score on each tile's scaled scores
            (ALiBi, soft-capping: gptmini.attention.masks), before the mask; tiles are still
            skipped by the mask alone.
        sinks: (num_heads,) each head's sink logit in the softmax's denominator
            (gptmini.attention.sinks): every row's online softmax starts from it, m = sink
            and l = 1, so no tile is needed for it; None: no sinks.

    Returns:
        (b, num_heads, num_tokens, head_dim); a query with no key to attend gets zeros.
    """
    return _TiledAttention.apply(q, k, v, mask, tile, skip_tiles, plan, score_mod, sinks)


class _Tiles:
    """Which tiles to compute, and each tile's mask: one plan for forward and backward."""

    def __init__(self, mask, batch, num_tokens, num_keys, tile, skip_tiles, device, plan=None,
                 score_mod=None):
        self.mask, self.tile, self.first = mask, tile, num_keys - num_tokens
        self.score_mod = score_mod
        self.nonlinear_mod = score_mod is not None and not getattr(score_mod, "additive", False)
        self.num_tokens, self.num_keys, self.batch = num_tokens, num_keys, batch
        self.device = device
        if mask is None:
            shape = (-(-num_tokens // tile), -(-num_keys // tile))
            self.some = torch.ones(shape, dtype=torch.bool)
            self.every = torch.ones(shape, dtype=torch.bool)
        else:
            some, every = plan or tile_plan(mask, batch, num_tokens, num_keys, tile, device)
            self.some, self.every = some.cpu(), every.cpu()  # read once, on the host
        if not skip_tiles:
            self.some = torch.ones_like(self.some)

    def rows(self, i: int) -> slice:
        return slice(i * self.tile, min((i + 1) * self.tile, self.num_tokens))

    def cols(self, j: int) -> slice:
        return slice(j * self.tile, min((j + 1) * self.tile, self.num_keys))

    def scores(self, q: Tensor, k: Tensor, i: int, j: int, scale: float, wide) -> Tensor:
        """Tile (i, j)'s scaled scores, modified (not yet masked)."""
        s = (q[:, :, self.rows(i)] @ k[:, :, self.cols(j)].transpose(-1, -2)).to(wide) * scale
        if self.score_mod is None:
            return s
        return apply_score_mod(self.score_mod, s, self.first + self.rows(i).start,
                               self.cols(j).start)

    def allowed(self, i: int, j: int) -> Tensor | None:
        """The mask on tile (i, j), (batch, 1, rows, cols); None where it allows all."""
        if bool(self.every[i, j]):
            return None
        rows, cols = self.rows(i), self.cols(j)
        return self.mask(*index_grids(self.batch, 1, self.first + rows.start,
                                      rows.stop - rows.start, cols.start,
                                      cols.stop - cols.start, self.device))


class _TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, tile, skip_tiles, known_plan, score_mod, sinks):
        plan = _Tiles(mask, q.shape[0], q.shape[2], k.shape[2], tile, skip_tiles, q.device,
                      known_plan, score_mod)
        wide = torch.promote_types(q.dtype, torch.float32)  # softmax sums in float32 or wider
        scale = q.shape[-1] ** -0.5
        out = q.new_zeros(*q.shape[:-1], v.shape[-1])  # values may be narrower (MLA)
        lse = torch.full(q.shape[:-1], -torch.inf, dtype=wide, device=q.device)  # (b, h, n)
        for i in range(plan.some.shape[0]):
            rows = plan.rows(i)
            m = torch.full(lse[..., rows].shape, -torch.inf, dtype=wide, device=q.device)
            l = torch.zeros_like(m)  # noqa: E741 - the paper's name for the running sum
            if sinks is not None:  # the sink's term first: exp(sink - m) = 1, no value
                m = sinks.detach().to(wide).view(1, -1, 1).expand_as(m).clone()
                l = torch.ones_like(m)  # noqa: E741
            acc = torch.zeros(*m.shape, v.shape[-1], dtype=wide, device=q.device)
            for j in torch.nonzero(plan.some[i]).flatten().tolist():
                cols = plan.cols(j)
                s = plan.scores(q, k, i, j, scale, wide)
                allowed = plan.allowed(i, j)
                if allowed is not None:
                    s = s.masked_fill(~allowed, -torch.inf)
                m_new = torch.maximum(m, s.amax(dim=-1))
                # A row with nothing allowed yet stays at -inf; shift it by 0, not by -inf.
                shift = torch.where(m_new == -torch.inf, 0.0, m_new)
                p = torch.exp(s - shift[..., None])  # (b, h, rows, cols)
                correction = torch.exp(m - shift)
                l = l * correction + p.sum(dim=-1)  # noqa: E741
                acc = acc * correction[..., None] + p.to(v.dtype) @ v[:, :, cols]
                m = m_new
            seen = l > 0  # False: a row the mask let see no key at all
            out[:, :, rows] = torch.where(seen[..., None], acc / l.clamp_min(1e-30)[..., None],
                                          0.0).to(q.dtype)
            lse[..., rows] = torch.where(seen, m + torch.log(l), -torch.inf)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.plan, ctx.scale = plan, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        plan, scale, wide = ctx.plan, ctx.scale, lse.dtype
        dq = torch.zeros(q.shape, dtype=wide, device=q.device)
        dk = torch.zeros(k.shape, dtype=wide, device=q.device)
        dv = torch.zeros(v.shape, dtype=wide, device=q.device)
        grad_out = grad_out.to(wide)
        # rowsum(dO * O) = sum_j P_ij dP_ij: the softmax's backward needs it once per row.
        delta = (grad_out * out.to(wide)).sum(dim=-1)  # (b, h, n)
        safe_lse = torch.where(lse == -torch.inf, 0.0, lse)  # empty rows: P is masked to 0
        for j in range(plan.some.shape[1]):
            cols = plan.cols(j)
            k_j, v_j = k[:, :, cols].to(wide), v[:, :, cols].to(wide)
            for i in torch.nonzero(plan.some[:, j]).flatten().tolist():
                rows = plan.rows(i)
                q_i = q[:, :, rows].to(wide)
                raw = (q_i @ k_j.transpose(-1, -2)) * scale
                with torch.enable_grad():  # a modifier's own derivative, for dS below
                    raw = raw.requires_grad_(plan.nonlinear_mod)
                    s = raw if plan.score_mod is None else apply_score_mod(
                        plan.score_mod, raw, plan.first + rows.start, cols.start)
                p = torch.exp(s.detach() - safe_lse[..., rows, None])  # recomputed, not stored
                allowed = plan.allowed(i, j)
                if allowed is not None:
                    p = p.masked_fill(~allowed, 0.0)
                d_o = grad_out[:, :, rows]
                dv[:, :, cols] += p.transpose(-1, -2) @ d_o
                dp = d_o @ v_j.transpose(-1, -2)
                ds = p * (dp - delta[..., rows, None])  # the softmax's Jacobian, row by row
                if plan.nonlinear_mod:  # through the modifier (a bias passes dS unchanged)
                    ds = torch.autograd.grad(s, raw, ds)[0]
                dq[:, :, rows] += (ds @ k_j) * scale
                dk[:, :, cols] += (ds.transpose(-1, -2) @ q_i) * scale
        d_sinks = None
        if sinks is not None:
            # The sink's weight P_s = exp(sink - lse) and its dP_s = dO . 0 = 0, so
            # dsink = sum over rows of P_s * (0 - delta), per head.
            p_sink = torch.exp(sinks.to(wide).view(1, -1, 1) - lse)  # (b, h, n)
            d_sinks = -(p_sink * delta).sum(dim=(0, 2)).to(sinks.dtype)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None,
                d_sinks)


class TiledKernel:
    """`tiled_attention`, memory linear in the length, with the context's
    tile plan (built once per forward pass for all layers). No attention dropout."""

    has_dropout = False
    has_sinks = True

    def __init__(self, tile: int = 256):
        self.tile = tile
        """Queries and keys per tile (256 was fastest of 128/256/512 at 4k tokens here)."""

    def __call__(self, queries: Tensor, keys: Tensor, values: Tensor, context,
                 dropout_p: float = 0.0, *, sinks: Tensor | None = None) -> Tensor:
        group = queries.shape[1] // keys.shape[1]
        return tiled_attention(queries, keys.repeat_interleave(group, dim=1),
                               values.repeat_interleave(group, dim=1), context.mask,
                               tile=self.tile, plan=self.plan(context),
                               score_mod=context.score_mod, sinks=sinks)

    def plan(self, context) -> tuple[Tensor, Tensor] | None:
        """(some, every) per (query tile, key tile) of the context's mask, on the host, or
        None for all keys: made once per forward pass for every layer (`context.once`)."""
        if context.mask is None:
            return None

        def make():
            some, every = tile_plan(context.mask, context.batch, context.num_tokens,
                                    context.num_keys, self.tile, context.device)
            return some.cpu(), every.cpu()  # read once, on the host

        return context.once(("tile_plan", self.tile), make)


def tile_plan(mask: MaskMod, batch: int, num_tokens: int, num_keys: int, tile: int,
              device=None) -> tuple[Tensor, Tensor]:
    """For each (query tile, key tile): may any query attend any key in it, and may all?

    Evaluates the mask one row of tiles at a time, so memory stays (batch, tile, num_keys).

    Returns:
        (some, every), each (num_tokens / tile, num_keys / tile) booleans (tiles rounded up),
        over the whole batch: a tile is skipped only if no row of the batch needs it, and
        computed without the mask only if every row may attend all of it.
    """
    first = num_keys - num_tokens
    q_tiles, k_tiles = -(-num_tokens // tile), -(-num_keys // tile)
    some = torch.zeros(q_tiles, k_tiles, dtype=torch.bool, device=device)
    every = torch.zeros(q_tiles, k_tiles, dtype=torch.bool, device=device)
    pad = k_tiles * tile - num_keys  # the last tile may be short: pad it with its own values
    for i in range(q_tiles):
        rows = min(tile, num_tokens - i * tile)
        grids = index_grids(batch, 1, first + i * tile, rows, 0, num_keys, device)
        allowed = mask(*grids).expand(batch, 1, rows, num_keys)
        if pad:  # repeat the last key's column: it changes neither "any" nor "all"
            allowed = torch.cat([allowed, allowed[..., -1:].expand(*allowed.shape[:3], pad)], -1)
        tiles = allowed.reshape(batch, rows, k_tiles, tile)  # (batch, tile, k_tiles, tile)
        some[i] = tiles.any(dim=3).any(dim=1).any(dim=0)
        every[i] = tiles.all(dim=3).all(dim=1).all(dim=0)
    return some, every

