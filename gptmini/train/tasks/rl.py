"""Reinforcement learning with verifiable rewards: GRPO on a task whose answers a program
checks.

One step, for a batch of prompts (`gptmini.data.rl.ProblemBatch`):

1. *sample* (`GRPO.sample`, at a batch's first inner step): G completions of each prompt
   from the current weights through the engine (`gptmini.generate.rollouts`), each rewarded
   by the task's checker (`gptmini.data.verifiable`), and every completion's advantage
   within its group (`gptmini.finetune.grpo`); with the KL term, the reference's
   log-probabilities too.
2. *learn* (`GRPO.loss`, at every inner step): the trainer's log-probabilities of the
   sampled tokens, and the clipped objective.

Validation decodes the held-out prompts greedily: val/pass_at_1 is the share answered
right. Metrics: train/reward (mean), response_length, zero_variance (the share of groups
whose rewards are all equal: they teach nothing), clip_fraction, ratio, kl (with the KL
term), rollout_tokens_per_sec, and logprob_gap: the largest gap between the trainer's and
the engine's log-probabilities of the sampled tokens (0 up to rounding: the samples were
drawn from the distribution being trained).
"""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import tiktoken
import torch
from torch import Tensor

from gptmini.analysis.verifiable import pass_at_1, rewards
from gptmini.chat import ChatTemplate
from gptmini.data.rl import ProblemBatch
from gptmini.data.verifiable import Problem, VerifiableTask
from gptmini.finetune.grpo import group_advantages, grpo_loss, zero_variance_share
from gptmini.finetune.reference import token_log_probs
from gptmini.generate.rollouts import Rollouts, rollout
from gptmini.model import GPTModel
from gptmini.train.tasks.base import Metrics, Task


@dataclass(frozen=True)
class GRPOSettings:
    """How GRPO samples and learns (`--model.grpo.*`); train.py sets them for an RL run
    (--data.rl.task). The inner steps over each batch are --data.rl.inner_steps. `check`
    them before use (the task does: jsonargparse would bury a refusal in __post_init__
    under a generic Union error)."""

    group_size: int = 8
    """G: completions sampled per prompt, compared within their group."""
    max_new_tokens: int = 16
    """Most tokens of a completion, its stop token included."""
    clip_eps: float = 0.2
    """The ratio is held within [1 - clip_eps, 1 + clip_eps] (binds from the 2nd inner step)."""
    kl_weight: float = 0.0
    """The KL term's weight to the starting weights; 0: off (see gptmini.finetune.grpo)."""
    format_weight: float = 0.0
    """Added to the reward of a well-formed completion that stopped (0: answers only)."""

    def check(self) -> "GRPOSettings":
        """These settings, or a ValueError naming the flag at fault and the fix."""
        checks = {"group_size": (self.group_size, lambda x: isinstance(x, int) and x >= 2,
                                 "an integer, 2 or more (a group compares its samples)"),
                  "max_new_tokens": (self.max_new_tokens, lambda x: isinstance(x, int) and x >= 1,
                                     "an integer, 1 or more"),
                  "clip_eps": (self.clip_eps, lambda x: 0 < x < 1, "a number in (0, 1), e.g. 0.2"),
                  "kl_weight": (self.kl_weight, lambda x: x >= 0, "0 (off) or a positive weight"),
                  "format_weight": (self.format_weight, lambda x: x >= 0,
                                    "0 (off) or a positive weight, e.g. 0.1")}
        for name, (value, ok, what) in checks.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or not ok(value):
                raise ValueError(f"--model.grpo.{name} {value!r} is invalid: use {what}")
        return self


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


class GRPO(Task):
    """GRPO (see the module docstring).

    Args:
        settings: GRPOSettings.
        verifier: the task's checker.
        tokenizer: the model's (completions are decoded for the checker).
        template: the chat template the prompts are rendered with; its stop tokens end a
            completion.
        seed: the rollouts' seeds start here (batch s, sample i: a stream of its own).
    """

    def __init__(self, settings: GRPOSettings, verifier: VerifiableTask,
                 tokenizer: tiktoken.Encoding, template: ChatTemplate, seed: int = 0):
        self.settings, self.verifier, self.tokenizer = settings.check(), verifier, tokenizer
        self.stop_ids = template.stop_ids(tokenizer)
        self.seed = seed
        self.needs_reference = settings.kl_weight > 0
        self._scored: Scored | None = None  # the batch's samples, for its inner steps

    def batch_size(self, batch: ProblemBatch) -> int:
        return len(batch.problems)

    def tokens(self, batch: ProblemBatch) -> int:
        return 0 if self._scored is None else self._scored.rows[0].numel()

    def loss(self, model: GPTModel, batch: ProblemBatch) -> tuple[Tensor, Metrics]:
        first = batch.inner == 0 or self._scored is None  # (a resume mid-batch samples anew)
        if first:
            self._scored = self.sample(model, batch.problems, batch.prompts, batch.step)
        return self.learn(model, self._scored, first)

    def validation_step(self, model: GPTModel, batch: ProblemBatch) -> Metrics:
        return {"pass_at_1": self.pass_at_1(model, batch.problems, batch.prompts)}

    def validation_end(self, reduce: Callable[[Tensor], Tensor],
                       logged: Mapping[str, Tensor]) -> Metrics:
        return {}

    def sample(self, model: GPTModel, problems: Sequence[Problem],
               prompts: Sequence[Sequence[int]], step: int) -> Scored:
        """G completions of each problem from `model`'s weights now, rewarded."""
        g = self.settings.group_size
        runs = rollout(model, prompts, g, max_new_tokens=self.settings.max_new_tokens,
                       stop_ids=self.stop_ids, seed=self.seed + step * len(prompts) * g)
        earned = rewards(self.verifier, self.tokenizer, problems, runs,
                         self.settings.format_weight).flatten()
        device = next(model.parameters()).device
        rows = tuple(t.to(device) for t in runs.rows(self.tokenizer.eot_token))
        reference = None
        if self.reference is not None:
            reference = self.reference(model, token_log_probs, rows[0], rows[1],
                                       loss_fn=self.lm_loss)
        return Scored(runs, earned, group_advantages(earned, g).to(device), rows, reference)

    def learn(self, model: GPTModel, scored: Scored, first: bool = True
              ) -> tuple[Tensor, Metrics]:
        """(the clipped loss over the samples, the step's metrics); `first`: the first inner
        step over them (it reports the rollouts and the engine-trainer gap)."""
        inputs, targets, old = scored.rows
        mask = targets != -100
        training = model.training
        model.eval()  # the samples were drawn without dropout: learn the same distribution
        try:
            logprobs = token_log_probs(model, inputs, targets, loss_fn=self.lm_loss)
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

    def pass_at_1(self, model: GPTModel, problems: Sequence[Problem],
                  prompts: Sequence[Sequence[int]]) -> Tensor:
        """The share of `problems` answered right by greedy decoding (one try each)."""
        return pass_at_1(model, self.verifier, self.tokenizer, self.stop_ids, problems,
                         prompts, self.settings.max_new_tokens)
