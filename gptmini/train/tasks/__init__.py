"""What a run teaches the model: a `Task` the LightningModule delegates the loss, the metrics
and the batch to (see base.py for the interface).

    language.py        LanguageModelling: the next token (a corpus, or chat records'
                       responses), its auxiliary losses, val/ppl and val/bpb
    classification.py  Classification: a class head read at the last real token, val/acc
    preference.py      DirectPreference: DPO on pairs of responses against the starting
                       weights; rewards, margin and accuracy
    rl.py              GRPO: groups sampled through the engine, rewarded by a task's
                       checker; val/pass_at_1

A new task is a file here with its `Task` and its branch in `task_for`, beside a data
module that yields its batches.
"""

from collections.abc import Mapping, Sequence

import tiktoken

from gptmini.chat import ChatTemplate
from gptmini.data.verifiable import VerifiableTask
from gptmini.finetune.dpo import DPO
from gptmini.train.tasks.base import Metrics, Task
from gptmini.train.tasks.classification import Classification
from gptmini.train.tasks.language import LanguageModelling
from gptmini.train.tasks.preference import DirectPreference
from gptmini.train.tasks.rl import GRPO, GRPOSettings

__all__ = ["GRPO", "Classification", "DirectPreference", "GRPOSettings", "LanguageModelling",
           "Metrics", "Task", "task_for"]


def task_for(*, tokenizer: tiktoken.Encoding, classes: Sequence[str] | None = None,
             dpo: Mapping | None = None, grpo: Mapping | None = None,
             verifier: VerifiableTask | None = None, template: ChatTemplate | None = None,
             loss_chunk_size: int | None = None) -> Task:
    """The task a run's settings ask for: classification when it has classes (train.py sets
    them from --data.labels), DPO with `dpo` settings (from --data.preference), GRPO with
    `grpo` settings and the `verifier` of --data.rl, else language modelling."""
    if classes:
        return Classification(classes)
    if dpo is not None:
        return DirectPreference(DPO(**dpo), loss_chunk_size)
    if grpo is not None:
        if verifier is None or template is None:
            raise ValueError("GRPO needs the task's checker and the chat template: train.py "
                             "gives them for --data.rl.task (in Python: verifier= and "
                             "chat_template=)")
        return GRPO(GRPOSettings(**grpo), verifier, tokenizer, template)
    return LanguageModelling(tokenizer, loss_chunk_size)
