"""What a run teaches the model: a `Task` the LightningModule delegates the loss, the metrics
and the batch to (see base.py for the interface).

    language.py        LanguageModelling: the next token (a corpus, or chat records'
                       responses), its auxiliary losses, val/ppl and val/bpb
    classification.py  Classification: a class head read at the last real token, val/acc

A new task (preference pairs next) is a file here with its `Task` and its branch in
`task_for`, beside a data module that yields its batches.
"""

from collections.abc import Sequence

import tiktoken

from gptmini.train.tasks.base import Metrics, Task
from gptmini.train.tasks.classification import Classification
from gptmini.train.tasks.language import LanguageModelling

__all__ = ["Classification", "LanguageModelling", "Metrics", "Task", "task_for"]


def task_for(*, tokenizer: tiktoken.Encoding, classes: Sequence[str] | None = None,
             loss_chunk_size: int | None = None) -> Task:
    """The task a run's settings ask for: classification when it has classes (train.py sets
    them from --data.labels), else language modelling."""
    if classes:
        return Classification(classes)
    return LanguageModelling(tokenizer, loss_chunk_size)
