"""Rollouts through the engine: groups of seeded samples whose log-probabilities, as the engine
reports them, are the trainer's (float32, within 1e-5), the stop token's included."""

import pytest
import torch

from gptmini.finetune.reference import token_log_probs
from gptmini.generate.rollouts import rollout
from gptmini.model import GPTConfig, GPTModel


def tiny_model(**changes) -> GPTModel:
    torch.manual_seed(0)
    settings = dict(vocab_size=64, context_length=48, emb_dim=32, n_heads=4, n_layers=2,
                    drop_rate=0.0)
    return GPTModel(GPTConfig(**{**settings, **changes}))


PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13, 14, 15, 16]]


@pytest.mark.parametrize("changes", [{}, {"norm": "rmsnorm", "mlp": "swiglu", "position": "rope",
                                          "n_kv_heads": 1, "qk_norm": True}])
def test_the_trainers_log_probs_of_the_sampled_tokens_are_the_engines(changes):
    model = tiny_model(**changes)
    runs = rollout(model, PROMPTS, 4, max_new_tokens=20, stop_ids=[0, 7], seed=3,
                   block_size=4)
    assert len(runs.completions) == 16 and runs.group_size == 4
    assert any(runs.stopped) and not all(runs.stopped)  # both endings are covered
    for completion, stopped in zip(runs.completions, runs.stopped, strict=True):
        assert (completion[-1] in (0, 7)) == stopped and len(completion) <= 20
    inputs, targets, engine = runs.rows(pad_id=0)
    model.train()  # the trainer's mode; dropout is 0
    trainer = token_log_probs(model, inputs, targets)
    counted = targets != -100
    assert counted.sum().item() == runs.num_tokens
    assert (trainer[counted] - engine[counted]).abs().max().item() < 1e-5
    assert model.training  # rollout gave the model back in the mode it found it


def test_each_sample_draws_its_own_seeded_stream():
    model = tiny_model()
    first = rollout(model, PROMPTS[:2], 4, max_new_tokens=12, stop_ids=[], seed=10)
    again = rollout(model, PROMPTS[:2], 4, max_new_tokens=12, stop_ids=[], seed=10)
    other = rollout(model, PROMPTS[:2], 4, max_new_tokens=12, stop_ids=[], seed=11)
    assert first.completions == again.completions
    assert len({tuple(c) for c in first.completions[:4]}) > 1  # a group's samples differ
    assert other.completions[:3] == first.completions[1:4]  # sample i draws seed + i's stream
    assert first.prompts == [PROMPTS[0]] * 4 + [PROMPTS[1]] * 4


def test_rows_put_each_completion_after_its_prompt_and_mask_the_rest():
    model = tiny_model()
    runs = rollout(model, [[1, 2, 3]], 2, max_new_tokens=5, stop_ids=[], seed=0)
    inputs, targets, old = runs.rows(pad_id=63)
    completion = runs.completions[0]
    assert inputs[0].tolist() == [1, 2, 3, *completion[:-1]]
    assert targets[0].tolist() == [-100, -100, *completion]
    assert old[0, :2].tolist() == [0.0, 0.0]


def test_a_prompt_and_its_completion_past_the_context_are_refused():
    with pytest.raises(ValueError, match="do not fit the context of 48 tokens.*lower "
                                         "max_new_tokens"):
        rollout(tiny_model(), [[1] * 40], 2, max_new_tokens=10, stop_ids=[], seed=0)
