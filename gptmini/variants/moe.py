"""A top-k routed mixture of experts as the blocks' feed-forward (the "moe" entry of
gptmini.model.feedforward.MLPS), in Qwen3-MoE's layout.

Letters in the shape comments:
    n       tokens routed at once (b * num_tokens: routing is per token)
    d       emb_dim
    E       experts
    k       top_k, the experts each token is sent to
    h       an expert's hidden width (mlp_hidden_dim)

Each token's router (`gate`, a d -> E linear) scores every expert; a softmax turns the
scores into probabilities, the k largest pick the token's experts (renormalized to sum to 1
with norm_topk_prob) and weight their outputs; each expert is a SwiGLU of width h. An
optional shared expert (another SwiGLU, DeepSeek's) sees every token. Only k experts run
per token, so the layer holds E times an expert's parameters for about k times its FLOPs.

The router is trained to spread the tokens by the Switch Transformer's load-balancing loss
(`aux_loss_coef` * E * sum_e f_e * P_e: f_e the share of the k assignments expert e got,
P_e its mean probability), computed as transformers' Qwen3-MoE computes it: f and P taken
over every layer's tokens together, so each layer hands in its (f, P) and
`MoE.finish_aux_losses` makes the one loss, the part "load_balance" (train/load_balance).

Names are Hugging Face's Qwen3MoeSparseMoeBlock's as its checkpoints store them (`gate`,
`experts.{e}.gate_proj`, ...), so gptmini.convert.llama maps them by rows; transformers 5
fuses the experts into 3-D tensors in memory, which its save_pretrained writes back as these.
"""

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gptmini.model import ConfigError, add_aux_loss, is_finite_number
from gptmini.model.feedforward import FeedForwardKind, SwiGLU, SwiGLUMLP

__all__ = ["BALANCE", "MoE", "MixtureOfExperts"]

BALANCE = "load_balance"
"""The auxiliary loss's name among forward's parts (train.py logs it as train/load_balance)."""


class MixtureOfExperts(nn.Module):
    """Top-k routed SwiGLU experts (and an optional shared one) over each token.

    Args:
        emb_dim: d.
        hidden_dim: each expert's hidden width h.
        experts: E.
        top_k: k, the experts a token is sent to.
        norm_topk_prob: renormalize the k chosen probabilities to sum to 1 (else they are
            the softmax's over all E, as Qwen3-MoE's config says).
        shared_hidden_dim: a shared expert's width, or None for none.
        bias: biases in the experts' projections.
        router_bias: a bias in the router (gpt-oss's; Qwen3-MoE's has none).
        expert: builds an expert as `expert(emb_dim, hidden_dim, bias)` (SwiGLU; gpt-oss's
            clamped one in gptmini.variants.oss_moe).
    """

    def __init__(self, emb_dim: int, hidden_dim: int, experts: int, top_k: int,
                 norm_topk_prob: bool = True, shared_hidden_dim: int | None = None,
                 bias: bool = False, router_bias: bool = False,
                 expert: Callable[[int, int, bool], nn.Module] = SwiGLU):
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = nn.Linear(emb_dim, experts, bias=router_bias)  # the router
        self.experts = nn.ModuleList(expert(emb_dim, hidden_dim, bias) for _ in range(experts))
        self.shared_expert = (None if shared_hidden_dim is None
                              else SwiGLU(emb_dim, shared_hidden_dim, bias))

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Qwen3-MoE's routing of x (n, d): softmax over the experts (in float32 at least),
        the top k, renormalized with norm_topk_prob. Returns the probabilities (n, E), the
        chosen experts (n, k) and their weights (n, k) in x's dtype."""
        logits = self.gate(x)  # (n, E)
        probs = F.softmax(logits, dim=-1, dtype=torch.promote_types(x.dtype, torch.float32))
        weights, chosen = probs.topk(self.top_k, dim=-1)  # (n, k) each
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return probs, chosen, weights.to(x.dtype)

    def forward(self, x: Tensor, aux_losses: dict[str, Tensor] | None = None) -> Tensor:
        """x (b, num_tokens, d) -> (b, num_tokens, d); with `aux_losses` (a training pass
        that asks for its parts) this layer's balance statistics are added to them."""
        flat = x.reshape(-1, x.shape[-1])  # (n, d)
        probs, chosen, weights = self.route(flat)
        out = self.dispatch(flat, chosen, weights)
        if self.shared_expert is not None:
            out = out + self.shared_expert(flat)
        if aux_losses is not None:
            add_aux_loss(aux_losses, BALANCE, balance_statistics(probs, chosen))
        return out.view(x.shape)

    def dispatch(self, x: Tensor, chosen: Tensor, weights: Tensor) -> Tensor:
        """Each token through its k experts, weighted: the (token, slot) assignments sorted
        by expert so that every expert runs once on its rows, then put back in place and
        summed over the slots (no atomic adds: the same sum on every device and run)."""
        n, k = chosen.shape
        flat_choice = chosen.flatten()  # (n * k,), token i's slot j at i * k + j
        order = flat_choice.argsort(stable=True)  # the assignments, grouped by expert
        counts = torch.bincount(flat_choice, minlength=len(self.experts)).tolist()
        rows = x[order // k]  # (n * k, d), expert 0's rows first
        outs = [expert(part) for expert, part in zip(self.experts, rows.split(counts),
                                                     strict=True)]
        placed = torch.empty_like(rows)
        placed[order] = torch.cat(outs)  # (n * k, d) back in (token, slot) order
        return (placed.view(n, k, -1) * weights.unsqueeze(-1)).sum(dim=1)  # (n, d)


def balance_statistics(probs: Tensor, chosen: Tensor) -> Tensor:
    """(2, E): the share of the k assignments each expert got (counted, no gradient) and
    its mean probability, over this layer's n tokens; summed over the layers by
    add_aux_loss, they make transformers' loss over all the layers' tokens together."""
    experts = probs.shape[-1]
    picked = chosen.unsqueeze(-1) == torch.arange(experts, device=chosen.device)  # (n, k, E)
    share = picked.sum(dim=(0, 1), dtype=probs.dtype) / chosen.shape[0]  # (E,)
    return torch.stack([share, probs.mean(dim=0)])


@dataclass(frozen=True)
class MoE(FeedForwardKind):
    """A mixture of experts as the blocks' feed-forward, from GPTConfig: mlp_hidden_dim is
    each expert's width (None: SwiGLU's default width / top_k, rounded up to a multiple of
    16, so the active experts cost about one SwiGLU), bias the experts', and mlp_options:

        experts            E, the experts per layer (8)
        top_k              k, the experts each token goes to (2)
        norm_topk_prob     renormalize the k weights to sum to 1 (True, Qwen3-30B-A3B's)
        aux_loss_coef      the load-balancing loss's weight (0.001, Qwen3-MoE's); 0: none
        shared_hidden_dim  a shared expert's width, or None for none (None; Qwen3-MoE has none)
    """

    options: ClassVar[tuple[str, ...]] = ("experts", "top_k", "norm_topk_prob",
                                          "aux_loss_coef", "shared_hidden_dim")
    aux_loss: ClassVar[bool] = True
    hf_layout: ClassVar[str | None] = "qwen3_moe"
    emb_dim: int
    hidden_dim: int
    experts: int = 8
    top_k: int = 2
    norm_topk_prob: bool = True
    aux_loss_coef: float = 0.001
    shared_hidden_dim: int | None = None
    bias: bool = False
    n_layers: int = 1

    @classmethod
    def from_config(cls, cfg: Any) -> "MoE":
        given = dict(cfg.mlp_options or {})
        fields = {name: given.get(name, cls.__dataclass_fields__[name].default)
                  for name in cls.options}
        for name, fix in cls.problems(fields):
            raise ConfigError("mlp_options", cfg.mlp_options,
                              f"the {cfg.mlp} feed-forward's {name} is {fields[name]!r}: "
                              f"use {fix}")
        hidden = cfg.mlp_hidden_dim or -(-SwiGLUMLP.from_config(cfg).hidden_dim
                                         // fields["top_k"] // 16) * 16
        return cls(cfg.emb_dim, hidden, bias=cfg.bias, n_layers=cfg.n_layers,
                   aux_loss_coef=float(fields.pop("aux_loss_coef")), **fields)

    @classmethod
    def problems(cls, fields: dict) -> Iterator[tuple[str, str]]:
        """(option, what to use) for each of `fields` (the options read) that is wrong."""
        experts, top_k = fields["experts"], fields["top_k"]
        for name, fine, fix in (
                ("experts", is_count(experts) and experts >= 2, "a whole number >= 2"),
                ("top_k", is_count(top_k) and is_count(experts) and top_k <= experts,
                 "a whole number from 1 to experts"),
                ("aux_loss_coef", is_finite_number(fields["aux_loss_coef"])
                 and fields["aux_loss_coef"] >= 0, "a number >= 0 (0: no balancing loss)")):
            if not fine:
                yield name, fix
        if "norm_topk_prob" in fields and not isinstance(fields["norm_topk_prob"], bool):
            yield "norm_topk_prob", "true or false"
        shared = fields.get("shared_hidden_dim")
        if not (shared is None or is_count(shared)):
            yield "shared_hidden_dim", "a positive width, or null"

    def make_module(self) -> MixtureOfExperts:
        return MixtureOfExperts(self.emb_dim, self.hidden_dim, self.experts, self.top_k,
                                self.norm_topk_prob, self.shared_hidden_dim, self.bias)

    def flops_per_token(self) -> float:
        """6 * N over the weights a token runs through: the router (d x E), its k experts'
        gate, up and down projections (3 * d * h each) and the shared expert's; the other
        E - k experts hold parameters but cost this token nothing."""
        active = self.top_k * self.hidden_dim + (self.shared_hidden_dim or 0)
        return 6 * (self.emb_dim * self.experts + 3 * self.emb_dim * active)

    def residual_weights(self, module: MixtureOfExperts) -> list[nn.Parameter]:
        experts = [*module.experts, *filter(None, [module.shared_expert])]
        return [expert.down_proj.weight for expert in experts]

    def finish_aux_losses(self, parts: dict[str, Tensor]) -> dict[str, Tensor]:
        """The load-balancing loss from the layers' summed statistics, transformers' way
        (`load_balancing_loss_func`: f and P over all the layers' tokens, whose product is
        not a sum over layers, hence statistics and not a loss per layer), weighted."""
        if BALANCE not in parts:
            return parts
        share, prob = parts[BALANCE] / self.n_layers  # (E,) each, over all the layers
        loss = self.aux_loss_coef * self.experts * (share * prob).sum()
        return {**parts, BALANCE: loss}


def is_count(value: object) -> bool:
    """A positive int (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
