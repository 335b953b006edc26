"""The GRPO objective term by term against numbers worked by hand: group-normalized
advantages, the clipped ratio, token-level normalization, the optional KL term."""

import math

import pytest
import torch

from gptmini.finetune.grpo import group_advantages, grpo_loss, zero_variance_share


def test_advantages_are_normalized_within_each_group():
    """Group (1, 0): mean 0.5, std (Bessel) 0.70710678, A = +-0.5 / (0.70710678 + 1e-4);
    group (1, 1): all equal, A = 0; group (3, 0, 0, 1) of G=4 checked the same way."""
    advantages = group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), 2)
    assert advantages.tolist() == pytest.approx([0.7070068, -0.7070068, 0.0, 0.0], abs=1e-6)
    rewards = torch.tensor([3.0, 0.0, 0.0, 1.0])
    std = math.sqrt(((3 - 1) ** 2 + 1 + 1 + 0) / 3)  # mean 1
    assert group_advantages(rewards, 4).tolist() == pytest.approx(
        [(r - 1) / (std + 1e-4) for r in (3, 0, 0, 1)], abs=1e-6)
    assert zero_variance_share(torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0]), 2).item() == (
        pytest.approx(2 / 3))
    with pytest.raises(ValueError, match="do not make groups of 4"):
        group_advantages(torch.zeros(6), 4)


def test_the_clipped_ratio_and_token_level_mean_by_hand():
    """Row 0 (A = +1): ratio 1.5 is clipped to 1.2 (-1.2, no gradient), ratio 0.5 is not
    (-0.5); row 1 (A = -1): ratio 1.5, the unclipped -1.5 is the min (+1.5). The loss is the
    mean over the 3 tokens, not of the rows' means: (-1.2 - 0.5 + 1.5) / 3."""
    old = torch.zeros(2, 3)
    logprobs = torch.tensor([[math.log(1.5), math.log(0.5), 9.0], [math.log(1.5), 9.0, 9.0]],
                            requires_grad=True)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    terms = grpo_loss(logprobs, old, torch.tensor([1.0, -1.0]), mask, clip_eps=0.2)
    assert terms.loss.item() == pytest.approx(-0.2 / 3, abs=1e-6)
    assert terms.clip_fraction.item() == pytest.approx(1 / 3)
    assert terms.ratio.item() == pytest.approx(3.5 / 3, abs=1e-6)
    assert terms.kl is None
    terms.loss.backward()
    # d(-ratio * A)/d logprob = -ratio * A, over 3 tokens; the clipped token gets none
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, -0.5 / 3, 0.0],
                                                           [0.5, 0.0, 0.0]]))


def test_with_one_inner_step_the_ratio_is_one_and_the_gradient_is_the_policy_gradient():
    logprobs = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], requires_grad=True)
    mask = torch.ones(2, 2, dtype=torch.bool)
    terms = grpo_loss(logprobs, logprobs.detach(), torch.tensor([0.5, -2.0]), mask)
    assert terms.ratio.item() == 1.0 and terms.clip_fraction.item() == 0.0
    terms.loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.5 / 4] * 2, [2.0 / 4] * 2]))


def test_the_kl_term_is_k3_to_the_reference_and_off_by_default():
    """d = log ref - log pi = log 2 at one token of three: KL = 2 - log 2 - 1."""
    logprobs = torch.tensor([[-1.0, -1.0, -1.0]], requires_grad=True)
    reference = torch.tensor([[-1.0 + math.log(2), -1.0, -1.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    zero = torch.zeros(1)
    terms = grpo_loss(logprobs, logprobs.detach(), zero, mask, kl_weight=0.1,
                      reference_logprobs=reference)
    kl = (2 - math.log(2) - 1) / 3
    assert terms.kl.item() == pytest.approx(kl, abs=1e-6)
    assert terms.loss.item() == pytest.approx(0.1 * kl, abs=1e-6)
    terms.loss.backward()  # d KL / d log pi = 1 - exp(d) = -1 at that token, 0 elsewhere
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.1 / 3, 0.0, 0.0]]))
    off = grpo_loss(logprobs, logprobs.detach(), zero, mask, reference_logprobs=reference)
    assert off.kl is None and off.loss.item() == 0.0
    with pytest.raises(ValueError, match="needs the reference"):
        grpo_loss(logprobs, logprobs.detach(), zero, mask, kl_weight=0.1)
