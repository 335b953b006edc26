"""Scoring a model on a task whose answers a program checks: pass@1 on held-out prompts.

    python evaluate.py --checkpoint runs/grpo-addition/checkpoints/best.ckpt --task
    python evaluate.py --checkpoint runs/sft-addition/checkpoints/last.ckpt --task addition

Each prompt is rendered by the model's chat template and answered greedily (one try, at
most `max_new_tokens` tokens, through the engine); pass@1 is the share the task's checker
marks right. The held-out prompts are an RL run's own (never trained on), or those a run of
the named task would hold out (its defaults: the first 200 of seed 0).
"""

from collections.abc import Mapping, Sequence

import tiktoken
import torch
from torch import nn

from gptmini.chat import ChatTemplate
from gptmini.data.rl import RL, prompt_ids
from gptmini.data.verifiable import Problem, VerifiableTask, split_problems
from gptmini.generate.rollouts import rollout


def pass_at_1(model: nn.Module, verifier: VerifiableTask, tokenizer: tiktoken.Encoding,
              stop_ids: Sequence[int], problems: Sequence[Problem],
              prompts: Sequence[Sequence[int]], max_new_tokens: int = 16) -> torch.Tensor:
    """The share of `problems` (their `prompts` rendered) answered right by greedy decoding."""
    runs = rollout(model, prompts, 1, max_new_tokens=max_new_tokens, stop_ids=stop_ids,
                   seed=0, temperature=0.0)
    right = 0
    for problem, completion, stopped in zip(problems, runs.completions, runs.stopped,
                                            strict=True):
        text = tokenizer.decode(completion[:-1] if stopped else completion)
        right += verifier.answer_reward(problem, text) >= 1.0
    return torch.tensor(right / len(problems))


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
               limit: int | None = None) -> tuple[float, str]:
    """(pass@1, what was scored) for evaluate.py --task (see the module docstring)."""
    settings, problems, name = held_out_problems(source, data_hparams)
    problems = problems[:limit]
    prompts = [prompt_ids(p, tokenizer, template) for p in problems]
    max_new = (hparams.get("grpo") or {}).get("max_new_tokens", 16)
    score = pass_at_1(model, settings.load(), tokenizer, template.stop_ids(tokenizer),
                      problems, prompts, max_new)
    return float(score), f"{name}, template {template.name}, greedy, {max_new} new tokens at most"
