"""Group Relative Policy Optimization (Shao et al. 2024, DeepSeekMath): the policy gradient of
verifiable rewards, with a completion's advantage measured against its own group.

For G completions of one prompt with rewards r_1..r_G, each completion's advantage is

    A_i = (r_i - mean(r)) / (std(r) + 1e-4)        (std with Bessel's correction, as TRL)

so a group whose completions all score the same teaches nothing (A = 0). Every token t of
completion i then gets the clipped surrogate of PPO, with the ratio of its probability now
to when it was sampled:

    ratio = exp(log pi(t) - log pi_old(t))
    loss_t = -min(ratio * A_i, clip(ratio, 1 - eps, 1 + eps) * A_i)  [+ kl_weight * KL_t]

and the loss is the mean over every completion token of the batch (token-level
normalization, DAPO's: a long completion counts by its tokens, not as one). With one inner
step the ratio is 1 and the clip never binds; more inner steps reuse the same samples. The
KL term to the reference (the k3 estimator, exp(d) - d - 1 with d = log ref - log pi) is off
by default: *Build a Reasoning Model (From Scratch)* ch. 6 measured the KL variant collapsing.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

ADVANTAGE_EPS = 1e-4
"""Added to a group's standard deviation (TRL's), so a near-uniform group stays finite."""


def group_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """(n,) the advantage of each of n = groups x G rewards, sample i in group i // G."""
    if rewards.numel() % group_size or group_size < 2:
        raise ValueError(f"{rewards.numel()} rewards do not make groups of {group_size}; GRPO "
                         "needs a group size of 2 or more, and whole groups")
    groups = rewards.view(-1, group_size).double()
    centred = groups - groups.mean(-1, keepdim=True)
    return (centred / (groups.std(-1, keepdim=True) + ADVANTAGE_EPS)).flatten().to(rewards.dtype)


def zero_variance_share(rewards: Tensor, group_size: int) -> Tensor:
    """The share of groups whose rewards are all equal: they add nothing to the gradient."""
    groups = rewards.view(-1, group_size)
    return (groups == groups[:, :1]).all(-1).float().mean()


@dataclass(frozen=True)
class GRPOTerms:
    """One batch's GRPO loss and what it did.

    Attributes:
        loss: the token-level mean (scalar, with gradients).
        clip_fraction: the share of tokens whose ratio the clip held (no gradient).
        ratio: the mean ratio over the tokens.
        kl: the mean KL estimate to the reference (None without one).
    """

    loss: Tensor
    clip_fraction: Tensor
    ratio: Tensor
    kl: Tensor | None = None


def grpo_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
              clip_eps: float = 0.2, kl_weight: float = 0.0,
              reference_logprobs: Tensor | None = None) -> GRPOTerms:
    """The clipped GRPO objective (see the module docstring).

    Args:
        logprobs: (n, num_tokens) log pi of each target token now, with gradients.
        old_logprobs: (n, num_tokens) the same when it was sampled.
        advantages: (n,) each completion's (`group_advantages`).
        mask: (n, num_tokens) True at the completion's tokens.
        clip_eps: the ratio is held within [1 - clip_eps, 1 + clip_eps].
        kl_weight: the KL term's weight; 0 leaves it out.
        reference_logprobs: (n, num_tokens) log ref of each token; needed with kl_weight.
    """
    if kl_weight and reference_logprobs is None:
        raise ValueError("kl_weight > 0 needs the reference's log-probabilities")
    mask = mask.to(logprobs.dtype)
    count = mask.sum().clamp(min=1)
    ratio = torch.exp(logprobs - old_logprobs.detach())
    advantage = advantages.detach()[:, None].to(logprobs.dtype)
    unclipped = ratio * advantage
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantage
    per_token = -torch.minimum(unclipped, clipped)
    kl = None
    if kl_weight:
        d = reference_logprobs.detach() - logprobs
        kl_per_token = torch.exp(d) - d - 1
        per_token = per_token + kl_weight * kl_per_token
        kl = (kl_per_token.detach() * mask).sum() / count
    held = (clipped < unclipped).to(logprobs.dtype)  # the min took the clipped value
    return GRPOTerms(loss=(per_token * mask).sum() / count,
                     clip_fraction=(held * mask).sum() / count,
                     ratio=(ratio.detach() * mask).sum() / count, kl=kl)
