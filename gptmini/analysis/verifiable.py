"""Scoring a model on a task whose answers a program checks, on held-out prompts.

    python evaluate.py --checkpoint runs/grpo-addition/checkpoints/best.ckpt --task
    python evaluate.py --checkpoint runs/sft-addition/checkpoints/last.ckpt --task addition

Each prompt is rendered by the model's chat template and answered through the engine (at
most `max_new_tokens` tokens); the task's checker scores each answer. Two measures, because
they can move apart: pass@1 is greedy decoding (one try each), what a user of the model
sees; the sampled reward is the mean reward of `samples` answers a prompt drawn at
temperature 1, what GRPO optimises (with pass@k: the share of prompts that any of the k
samples answered right, what GRPO can learn from). The held-out prompts are an RL run's own
(never trained on), or those a run of the named task would hold out (its defaults: the
first 200 of seed 0).
"""

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import tiktoken
import torch
from torch import nn

from gptmini.chat import ChatTemplate
from gptmini.data.rl import RL, prompt_ids
from gptmini.data.verifiable import Problem, VerifiableTask, split_problems
from gptmini.generate.rollouts import Rollouts, rollout


def rewards(verifier: VerifiableTask, tokenizer: tiktoken.Encoding, problems: Sequence[Problem],
            runs: Rollouts, format_weight: float = 0.0) -> torch.Tensor:
    """(len(problems), G) the reward of each of `runs`' samples (G a problem), its stop id
    left out of the text: the answer's, plus `format_weight` for a well-formed answer that
    stopped (`VerifiableTask.reward`; 0: the answer's alone)."""
    g = runs.group_size
    return torch.tensor([
        verifier.reward(problems[i // g],
                        tokenizer.decode(completion[:-1] if stopped else completion), stopped,
                        format_weight)
        for i, (completion, stopped) in enumerate(zip(runs.completions, runs.stopped,
                                                      strict=True))]).view(-1, g)


def pass_at_1(model: nn.Module, verifier: VerifiableTask, tokenizer: tiktoken.Encoding,
              stop_ids: Sequence[int], problems: Sequence[Problem],
              prompts: Sequence[Sequence[int]], max_new_tokens: int = 16) -> torch.Tensor:
    """The share of `problems` (their `prompts` rendered) answered right by greedy decoding."""
    runs = rollout(model, prompts, 1, max_new_tokens=max_new_tokens, stop_ids=stop_ids,
                   seed=0, temperature=0.0)
    return (rewards(verifier, tokenizer, problems, runs) >= 1.0).float().mean()


def sampled_reward(model: nn.Module, verifier: VerifiableTask, tokenizer: tiktoken.Encoding,
                   stop_ids: Sequence[int], problems: Sequence[Problem],
                   prompts: Sequence[Sequence[int]], max_new_tokens: int = 16, *,
                   samples: int = 8, seed: int = 0) -> tuple[float, float]:
    """(the mean reward of `samples` answers a problem drawn at temperature 1, pass@samples:
    the share of problems any of them answered right); seeded, so a score repeats."""
    runs = rollout(model, prompts, samples, max_new_tokens=max_new_tokens, stop_ids=stop_ids,
                   seed=seed)
    scored = rewards(verifier, tokenizer, problems, runs)
    return scored.mean().item(), (scored >= 1.0).any(-1).double().mean().item()


class TaskScore(NamedTuple):
    """What `evaluate.py --task` prints (see the module docstring)."""

    pass_at_1: float
    reward: float | None
    """The sampled answers' mean reward (None with no samples)."""
    pass_at_k: float | None
    samples: int


def held_out_problems(source: str, hparams: Mapping) -> tuple[RL, list[Problem], str]:
    """(the task's settings, its held-out problems, their name): "auto" takes an RL run's
    task (its data settings, `hparams`); a name, that shipped task with its defaults."""
    if source == "auto":
        saved = hparams.get("rl")
        if not saved:
            raise ValueError("--task needs a task for a checkpoint of a run without one: "
                             "--task addition (or reverse, count)")
        settings = RL(**saved)
    else:
        settings = RL(task=source)
    verifier = settings.load()
    heldout = split_problems(verifier, settings.train_prompts, settings.heldout,
                             settings.seed)[1]
    return settings, heldout, f"{len(heldout)} held-out prompts of {settings.task}"


def score_task(model: nn.Module, tokenizer: tiktoken.Encoding, template: ChatTemplate,
               source: str, hparams: Mapping, data_hparams: Mapping,
               limit: int | None = None, samples: int = 8) -> tuple[TaskScore, str]:
    """(the scores, what was scored) for evaluate.py --task (see the module docstring)."""
    settings, problems, name = held_out_problems(source, data_hparams)
    problems = problems[:limit]
    prompts = [prompt_ids(p, tokenizer, template) for p in problems]
    max_new = (hparams.get("grpo") or {}).get("max_new_tokens", 16)
    verifier, stop_ids = settings.load(), template.stop_ids(tokenizer)
    greedy = float(pass_at_1(model, verifier, tokenizer, stop_ids, problems, prompts, max_new))
    reward = pass_at_k = None
    if samples:
        reward, pass_at_k = sampled_reward(model, verifier, tokenizer, stop_ids, problems,
                                           prompts, max_new, samples=samples)
    return (TaskScore(greedy, reward, pass_at_k, samples),
            f"{name}, template {template.name}, {max_new} new tokens at most")
