"""Direct Preference Optimization (Rafailov et al. 2023): a policy learns to prefer the chosen
response over the rejected one, relative to a frozen reference (the starting weights).

Eq. 7 of the paper, for a prompt x with chosen response y_w and rejected y_l:

    loss = -log sigmoid(beta * [(log pi(y_w|x) - log ref(y_w|x))
                                - (log pi(y_l|x) - log ref(y_l|x))])

with each log-probability summed over the response's tokens ("paper"). The book's chapter 7
bonus (LLMs-from-scratch ch07/04) averages them per response token instead ("book"), so a
long response weighs no more than a short one. The implicit rewards are beta times each log
ratio; their margin is chosen minus rejected, and a pair is ranked right when it is > 0.
"""

from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor

VARIANTS = ("paper", "book")
"""How a response's log-probability is taken: summed over its tokens (the paper's eq. 7) or
averaged per token (the book's chapter 7 bonus)."""


@dataclass(frozen=True)
class DPO:
    """Direct Preference Optimization's settings (`--model.dpo.*`); train.py sets them for a
    run on preference pairs (--data.preference.records). `check` them before use (the task
    does: jsonargparse would bury a refusal in __post_init__ under a generic Union error)."""

    beta: float = 0.1
    """How far the policy may move from the reference: larger keeps it closer (the paper's
    and the book's 0.1)."""
    variant: str = "paper"
    """"paper": a response's log-probability summed over its tokens (eq. 7); "book": averaged
    per token (the book's chapter 7 bonus)."""

    def check(self) -> "DPO":
        """These settings, or a ValueError naming the flag at fault and the fix."""
        check_beta(self.beta)
        check_variant(self.variant)
        return self

    @property
    def average(self) -> bool:
        """Whether log-probabilities are averaged per response token (the book's)."""
        return self.variant == "book"


@dataclass(frozen=True)
class DPOTerms:
    """One batch's DPO loss and what it says about the pairs.

    Attributes:
        loss: the mean of the pairs' losses (scalar, with gradients).
        chosen_rewards: (b,) beta * (log pi - log ref) of the chosen responses, detached.
        rejected_rewards: (b,) the same for the rejected ones.
    """

    loss: Tensor
    chosen_rewards: Tensor
    rejected_rewards: Tensor

    @property
    def margins(self) -> Tensor:
        """(b,) chosen minus rejected reward: how far each pair is ranked right."""
        return self.chosen_rewards - self.rejected_rewards

    @property
    def accuracy(self) -> Tensor:
        """The share of pairs ranked right (margin > 0): preference accuracy."""
        return (self.margins > 0).float().mean()

    def metrics(self) -> dict[str, Tensor]:
        """The batch's scalars by name, as a run logs them."""
        return {"loss": self.loss, "chosen_reward": self.chosen_rewards.mean(),
                "rejected_reward": self.rejected_rewards.mean(),
                "margin": self.margins.mean(), "accuracy": self.accuracy}


def dpo_loss(policy_chosen: Tensor, policy_rejected: Tensor, reference_chosen: Tensor,
             reference_rejected: Tensor, beta: float = 0.1) -> DPOTerms:
    """The DPO loss (eq. 7) from each response's log-probability under both models.

    Args:
        policy_chosen: (b,) log pi(y_w|x), with gradients.
        policy_rejected: (b,) log pi(y_l|x), with gradients.
        reference_chosen: (b,) log ref(y_w|x).
        reference_rejected: (b,) log ref(y_l|x).
        beta: how far the policy may move from the reference (larger: less far).
    """
    check_beta(beta)
    chosen = policy_chosen - reference_chosen.detach()
    rejected = policy_rejected - reference_rejected.detach()
    loss = -F.logsigmoid(beta * (chosen - rejected)).mean()
    return DPOTerms(loss, beta * chosen.detach(), beta * rejected.detach())


def check_beta(beta: float) -> None:
    """Raise a ValueError naming beta unless it is a positive finite number."""
    if not isinstance(beta, int | float) or isinstance(beta, bool) or not 0 < beta < float(
            "inf"):
        raise ValueError(f"--model.dpo.beta {beta!r} is invalid: use a positive number, such "
                         "as 0.1 (the paper's and the book's)")


def check_variant(variant: str) -> None:
    """Raise a ValueError naming the variant unless it is one of VARIANTS."""
    if variant not in VARIANTS:
        raise ValueError(f"--model.dpo.variant {variant!r}: use 'paper' (log-probabilities summed "
                         "over the response, eq. 7) or 'book' (averaged per token, the "
                         "book's chapter 7 bonus)")
