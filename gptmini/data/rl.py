"""The data of reinforcement learning on a verifiable task: batches of prompts for GRPO's
groups, and held-out prompts for pass@1.

A batch is a `ProblemBatch`: the problems (what the task's checker reads), their prompts
rendered by the run's chat template for the assistant to answer (token ids), and which
batch of the epoch it is and which of its inner steps (the same batch comes `inner_steps`
times in a row: the first samples the completions, the others learn from them again). Each
item of `ProblemBatches` is a whole batch, so the loader takes them one at a time.
"""

import random
from dataclasses import dataclass
from typing import NamedTuple

import tiktoken
from torch.utils.data import Dataset

from gptmini.chat import ChatTemplate, render_chat
from gptmini.data.verifiable import Problem, VerifiableTask, load_task, split_problems

VALIDATION_BATCH = 64
"""Held-out prompts decoded together (one engine run) for pass@1."""


@dataclass(frozen=True)
class RL:
    """Reinforcement learning on a task whose answers a program checks (`--data.rl.*`): the
    prompts of GRPO's groups, and the held-out ones pass@1 is measured on."""

    task: str | None = None
    """"addition", "reverse" or "count" (shipped, drawn from `seed`), or "file" (your
    `prompts` and `reward`). None: not an RL run."""
    size: int | None = None
    """A shipped task's size: digits per number, letters per word or string (None: its
    default: 3, 4, 8)."""
    prompts: str | None = None
    """With task "file": a .jsonl of records with a "prompt" (and what your reward reads)."""
    reward: str | None = None
    """With task "file": "module:function", called as reward(completion, record) -> float."""
    train_prompts: int = 20_000
    """Distinct training prompts drawn (a file's: at most its records, less the held-out)."""
    heldout: int = 200
    """Held-out prompts (never trained on) that val/pass_at_1 is measured on."""
    seed: int = 0
    """Which prompts a shipped task draws (the held-out ones are the first `heldout`)."""
    template: str = "auto"
    """The chat template, as --data.chat.template: "auto" keeps the source model's own
    (else gptmini's)."""
    inner_steps: int = 1
    """Optimizer steps over each batch's samples (PPO's epochs): the batch comes this many
    times, sampled the first; the clipped ratio binds from the second."""

    def __post_init__(self):
        for name in ("train_prompts", "heldout", "inner_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--data.rl.{name} {value!r} is invalid: use an integer, 1 "
                                 "or more")

    @property
    def active(self) -> bool:
        return self.task is not None

    def load(self) -> VerifiableTask:
        """The task these settings name (`load_task`): a reward function that cannot be
        imported fails here, before any training."""
        return load_task(self.task, size=self.size, prompts=self.prompts, reward=self.reward)


class ProblemBatch(NamedTuple):
    """One step's prompts (a tuple, so it passes Lightning's device transfer as it is)."""

    problems: list[Problem]
    prompts: list[list[int]]
    """Each problem rendered for the assistant to answer (the template's generation prompt)."""
    step: int
    """The batch's place in the epoch (its rollouts' seeds follow it)."""
    inner: int
    """Which of its inner steps: 0 samples, the others reuse the samples."""


class ProblemBatches(Dataset):
    """Problems in batches of `batch_size` (a seeded order), each batch `inner_steps` times in
    a row; item i is batch i // inner_steps. The last batch may be short (validation)."""

    def __init__(self, problems: list[Problem], prompts: list[list[int]], batch_size: int, *,
                 inner_steps: int = 1, seed: int | None = 0, drop_last: bool = True):
        order = list(range(len(problems)))
        if seed is not None:
            random.Random(seed).shuffle(order)
        end = len(order) - len(order) % batch_size if drop_last else len(order)
        self.batches = [order[i:i + batch_size] for i in range(0, end, batch_size)]
        self.problems, self.prompts, self.inner_steps = problems, prompts, inner_steps

    def __len__(self) -> int:
        return len(self.batches) * self.inner_steps

    def __getitem__(self, index: int) -> ProblemBatch:
        step, inner = divmod(index, self.inner_steps)
        chosen = self.batches[step]
        return ProblemBatch([self.problems[i] for i in chosen],
                            [self.prompts[i] for i in chosen], step, inner)


def prompt_ids(problem: Problem, tokenizer: tiktoken.Encoding, template: ChatTemplate) -> list[int]:
    """The problem rendered for the assistant to answer (the template's generation prompt)."""
    return render_chat(list(problem.messages), tokenizer, template, add_generation_prompt=True,
                       mask=False, where=problem.where).ids


def rl_datasets(settings: RL, task: VerifiableTask, tokenizer: tiktoken.Encoding,
                template: ChatTemplate, batch_size: int, max_length: int
                ) -> tuple[ProblemBatches, ProblemBatches, str]:
    """(training batches, held-out batches, a line saying what was drawn).

    Raises:
        ValueError: a prompt too long for the context (naming it), or too few prompts.
    """
    train, heldout = split_problems(task, settings.train_prompts, settings.heldout,
                                    settings.seed)
    if len(train) < batch_size:
        raise ValueError(f"--data.rl.task {settings.task}: {len(train)} training prompts, "
                         f"fewer than --data.loader.batch_size {batch_size}")
    built = []
    for part in (train, heldout):
        ids = [prompt_ids(p, tokenizer, template) for p in part]
        longest = max(range(len(ids)), key=lambda i: len(ids[i]))
        if len(ids[longest]) >= max_length:
            raise ValueError(f"{part[longest].where}: the prompt is {len(ids[longest])} tokens, "
                             f"no room left in the context of {max_length} to answer; "
                             "shorten it or raise --model.context_length")
        built.append(ids)
    line = (f"rl task {task.name}, template {template.name}: {len(train):,} training prompts "
            f"in batches of {batch_size} ({settings.inner_steps} inner step(s) each), "
            f"{len(heldout):,} held out")
    return (ProblemBatches(train, built[0], batch_size, inner_steps=settings.inner_steps,
                           seed=settings.seed),
            ProblemBatches(heldout, built[1], VALIDATION_BATCH, seed=None, drop_last=False),
            line)
