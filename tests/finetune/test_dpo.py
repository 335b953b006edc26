"""The DPO loss term by term against numbers worked by hand, and the reference model: the
starting weights, frozen, with LoRA's adapters off (no copy) or as a frozen copy."""

import math

import pytest
import torch

from gptmini.finetune import add_lora
from gptmini.finetune.dpo import DPO, check_variant, dpo_loss
from gptmini.finetune.lora import adapters_off
from gptmini.finetune.reference import Reference, sequence_log_probs
from gptmini.model import GPTConfig, GPTModel


def tiny_model() -> GPTModel:
    torch.manual_seed(0)
    return GPTModel(GPTConfig(vocab_size=64, context_length=16, emb_dim=16, n_heads=2,
                              n_layers=2, drop_rate=0.0)).double()


def test_each_term_against_numbers_worked_by_hand():
    """Pair 1: log ratios +1 (chosen) and -1 (rejected), beta 0.1: logit 0.2, loss
    log(1 + e^-0.2) = 0.5981388693, rewards +0.1 and -0.1, margin 0.2, ranked right.
    Pair 2: both log ratios 0.5: logit 0, loss log 2, margin 0, not ranked right."""
    policy_chosen = torch.tensor([-10.0, -5.0], dtype=torch.float64, requires_grad=True)
    policy_rejected = torch.tensor([-12.0, -4.0], dtype=torch.float64, requires_grad=True)
    terms = dpo_loss(policy_chosen, policy_rejected, torch.tensor([-11.0, -5.5]),
                     torch.tensor([-11.0, -4.5]), beta=0.1)
    assert terms.loss.item() == pytest.approx((0.5981388693 + math.log(2)) / 2, abs=1e-9)
    assert terms.chosen_rewards.tolist() == pytest.approx([0.1, 0.05])
    assert terms.rejected_rewards.tolist() == pytest.approx([-0.1, 0.05])
    assert terms.margins.tolist() == pytest.approx([0.2, 0.0])
    assert terms.accuracy.item() == 0.5
    metrics = terms.metrics()
    assert metrics["margin"].item() == pytest.approx(0.1)
    assert metrics["chosen_reward"].item() == pytest.approx(0.075)
    # d loss / d log pi(y_w) = -beta * sigmoid(-logit) / b: sigmoid(-0.2) = 0.4501660027
    terms.loss.backward()
    assert policy_chosen.grad.tolist() == pytest.approx([-0.1 * 0.4501660027 / 2, -0.1 * 0.5 / 2])
    assert policy_rejected.grad.tolist() == pytest.approx([0.1 * 0.4501660027 / 2, 0.1 * 0.5 / 2])


def test_beta_scales_the_logit_and_a_bad_beta_or_variant_is_named():
    args = [torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([-2.0]), torch.tensor([-2.0])]
    assert dpo_loss(*args, beta=0.5).loss.item() == pytest.approx(math.log1p(math.exp(-1.0)))
    for beta in (0, -0.1, float("nan"), float("inf"), "0.1", True):
        with pytest.raises(ValueError, match="--model.dpo.beta .* is invalid: use a positive"):
            dpo_loss(*args, beta=beta)
    with pytest.raises(ValueError, match="--model.dpo.variant 'mean': use 'paper' .* or 'book'"):
        check_variant("mean")
    with pytest.raises(ValueError, match="--model.dpo.beta 0 is invalid"):
        DPO(beta=0).check()
    assert DPO(variant="book").average and not DPO().average


def test_the_reference_of_a_lora_model_is_its_base_with_no_copy():
    """Adapters off: the base's exact log-probabilities, after the adapters moved away from
    zero; and the adapters are back on after the reference's pass."""
    base = tiny_model()
    inputs = torch.randint(0, 64, (2, 8))
    targets = torch.randint(0, 64, (2, 8))
    want = sequence_log_probs(base, inputs, targets)
    add_lora(base, rank=2, alpha=4.0)
    for name, p in base.named_parameters():
        if name.endswith("lora_B"):
            p.data.normal_()
    reference = Reference(base)
    assert reference.copy is None and reference.extra_bytes == 0
    adapted = sequence_log_probs(base, inputs, targets)
    assert not torch.allclose(adapted, want)
    torch.testing.assert_close(reference(base, sequence_log_probs, inputs, targets), want,
                               rtol=0, atol=0)
    torch.testing.assert_close(sequence_log_probs(base, inputs, targets), adapted)
    with adapters_off(base):
        torch.testing.assert_close(sequence_log_probs(base, inputs, targets), want)


def test_the_reference_of_a_full_fine_tune_is_a_frozen_copy_of_the_starting_weights():
    model = tiny_model()
    inputs, targets = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))
    want = sequence_log_probs(model, inputs, targets).detach()
    reference = Reference(model)
    params = sum(p.numel() for p in model.parameters())
    assert reference.extra_bytes == params * 8  # float64: one more set of weights
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    (-sequence_log_probs(model, inputs, targets).sum()).backward()
    optimizer.step()
    assert not torch.allclose(sequence_log_probs(model, inputs, targets), want)
    got = reference(model, sequence_log_probs, inputs, targets)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not got.requires_grad
    assert all(not p.requires_grad for p in reference.copy.parameters())
