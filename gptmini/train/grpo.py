"""GRPO on a verifiable task: sample groups through the engine, score them, and the loss.

One step of the task, for a batch of prompts:

1. *sample* (`GRPO.sample`): G completions of each prompt from the current weights
   (`gptmini.generate.rollouts`), each rewarded by the task's checker
   (`gptmini.data.verifiable`), and every completion's advantage within its group
   (`gptmini.finetune.grpo`); with the KL term, the reference's log-probabilities too.
2. *learn* (`GRPO.loss`), `inner_steps` times over the same samples: the trainer's
   log-probabilities of the sampled tokens, and the clipped objective.

`pass_at_1` decodes held-out prompts greedily and counts the right answers. The metrics:
mean reward, response length, the share of groups whose rewards are all equal (they teach
nothing), the clip fraction and mean ratio, rollout tokens/s, and at each first inner step
the largest gap between the trainer's and the engine's log-probabilities (0 up to rounding:
the samples were drawn from the distribution being trained).
"""

from collections.abc import Sequence
from dataclasses import dataclass

import tiktoken
import torch
from torch import Tensor, nn

from gptmini.chat import ChatTemplate, render_chat
from gptmini.data.verifiable import Problem, VerifiableTask
from gptmini.finetune.grpo import group_advantages, grpo_loss, zero_variance_share
from gptmini.finetune.reference import Reference, token_log_probs
from gptmini.generate.rollouts import Rollouts, rollout


@dataclass(frozen=True)
class GRPOSettings:
    """How GRPO samples and learns (`--model.grpo.*`)."""

    group_size: int = 8
    """G: completions sampled per prompt, compared within their group."""
    max_new_tokens: int = 16
    """Most tokens of a completion, its stop token included."""
    inner_steps: int = 1
    """Optimizer steps over the same samples (PPO's epochs); 1: plain on-policy."""
    clip_eps: float = 0.2
    """The ratio is held within [1 - clip_eps, 1 + clip_eps] (binds from the 2nd inner step)."""
    kl_weight: float = 0.0
    """The KL term's weight to the starting weights; 0: off (see gptmini.finetune.grpo)."""
    format_weight: float = 0.0
    """Added to the reward of a well-formed completion that stopped (0: answers only)."""

    def __post_init__(self):
        checks = {"group_size": (self.group_size, lambda x: isinstance(x, int) and x >= 2,
                                 "an integer, 2 or more (a group compares its samples)"),
                  "max_new_tokens": (self.max_new_tokens, lambda x: isinstance(x, int) and x >= 1,
                                     "an integer, 1 or more"),
                  "inner_steps": (self.inner_steps, lambda x: isinstance(x, int) and x >= 1,
                                  "an integer, 1 or more"),
                  "clip_eps": (self.clip_eps, lambda x: 0 < x < 1, "a number in (0, 1), e.g. 0.2"),
                  "kl_weight": (self.kl_weight, lambda x: x >= 0, "0 (off) or a positive weight"),
                  "format_weight": (self.format_weight, lambda x: x >= 0,
                                    "0 (off) or a positive weight, e.g. 0.1")}
        for name, (value, ok, what) in checks.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or not ok(value):
                raise ValueError(f"--model.grpo.{name} {value!r} is invalid: use {what}")


@dataclass(frozen=True)
class Scored:
    """One batch's samples, rewarded: what every inner step learns from."""

    rollouts: Rollouts
    rewards: Tensor
    """(n,) each completion's reward."""
    advantages: Tensor
    """(n,) within its group."""
    rows: tuple[Tensor, Tensor, Tensor]
    """(inputs, targets, the engine's log-probabilities), each (n, width) (Rollouts.rows)."""
    reference: Tensor | None = None
    """(n, width) the reference's log-probabilities, with the KL term."""


class GRPO:
    """GRPO on `task`, its prompts rendered by `template` (see the module docstring).

    Args:
        task: the prompts' checker.
        tokenizer: the model's.
        template: the chat template the model was tuned with; its stop tokens end a completion.
        settings: GRPOSettings.
        seed: the rollouts' seeds start here (step s, sample i: a stream of its own).
    """

    def __init__(self, task: VerifiableTask, tokenizer: tiktoken.Encoding,
                 template: ChatTemplate, settings: GRPOSettings = GRPOSettings(),  # noqa: B008
                 seed: int = 0):
        self.task, self.tokenizer, self.template = task, tokenizer, template
        self.settings, self.seed = settings, seed
        self.stop_ids = template.stop_ids(tokenizer)
        self.reference: Reference | None = None
        """The starting weights, frozen, with the KL term (`start`)."""

    def start(self, model: nn.Module) -> None:
        """Call once the model holds its starting weights: keeps them with the KL term."""
        if self.settings.kl_weight and self.reference is None:
            self.reference = Reference(model)

    def prompt_ids(self, problem: Problem) -> list[int]:
        """The prompt rendered for the assistant to answer (the template's generation prompt)."""
        return render_chat(list(problem.messages), self.tokenizer, self.template,
                           add_generation_prompt=True, mask=False, where=problem.where).ids

    def sample(self, model: nn.Module, problems: Sequence[Problem], step: int) -> Scored:
        """G completions of each problem from `model`'s weights now, rewarded."""
        g = self.settings.group_size
        runs = rollout(model, [self.prompt_ids(p) for p in problems], g,
                       max_new_tokens=self.settings.max_new_tokens, stop_ids=self.stop_ids,
                       seed=self.seed + step * len(problems) * g)
        rewards = torch.tensor([
            self.task.reward(problems[i // g], self._text(completion, stopped), stopped,
                             self.settings.format_weight)
            for i, (completion, stopped) in enumerate(zip(runs.completions, runs.stopped,
                                                          strict=True))])
        device = next(model.parameters()).device
        rows = tuple(t.to(device) for t in runs.rows(self.tokenizer.eot_token))
        reference = None
        if self.reference is not None:
            reference = self.reference(model, token_log_probs, rows[0], rows[1])
        return Scored(runs, rewards, group_advantages(rewards, g).to(device), rows, reference)

    def _text(self, completion: list[int], stopped: bool) -> str:
        return self.tokenizer.decode(completion[:-1] if stopped else completion)

    def loss(self, model: nn.Module, scored: Scored, first: bool = True
             ) -> tuple[Tensor, dict[str, Tensor]]:
        """(the clipped loss over the samples, the step's metrics); `first`: the first inner
        step over them (it reports the rollouts and the engine-trainer gap)."""
        inputs, targets, old = scored.rows
        mask = targets != -100
        training = model.training
        model.eval()  # the samples were drawn without dropout: learn the same distribution
        try:
            logprobs = token_log_probs(model, inputs, targets)
        finally:
            model.train(training)
        terms = grpo_loss(logprobs, old, scored.advantages, mask,
                          clip_eps=self.settings.clip_eps, kl_weight=self.settings.kl_weight,
                          reference_logprobs=scored.reference)
        metrics = {"loss": terms.loss.detach(), "clip_fraction": terms.clip_fraction,
                   "ratio": terms.ratio}
        if terms.kl is not None:
            metrics["kl"] = terms.kl
        if first:
            runs = scored.rollouts
            metrics.update(
                reward=scored.rewards.mean(),
                response_length=torch.tensor(runs.num_tokens / len(runs.completions)),
                zero_variance=zero_variance_share(scored.rewards, runs.group_size),
                rollout_tokens_per_sec=torch.tensor(runs.num_tokens / max(runs.seconds, 1e-9)),
                logprob_gap=(logprobs.detach() - old).abs().masked_fill(~mask, 0).max())
        return terms.loss, metrics

    def pass_at_1(self, model: nn.Module, problems: Sequence[Problem]) -> Tensor:
        """The share of `problems` answered right by greedy decoding (one try each)."""
        runs = rollout(model, [self.prompt_ids(p) for p in problems], 1,
                       max_new_tokens=self.settings.max_new_tokens, stop_ids=self.stop_ids,
                       seed=0, temperature=0.0)
        right = [self.task.answer_reward(p, self._text(c, s)) >= 1.0
                 for p, c, s in zip(problems, runs.completions, runs.stopped, strict=True)]
        return torch.tensor(sum(right) / len(right))
