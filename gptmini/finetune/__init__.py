"""Fine-tuning a pretrained GPT: LoRA adapters (lora.py), a class head read at each
sequence's last real token (classify.py), and room in the vocabulary for a chat template's
tokens (vocab.py). Imports only torch and the model; the chat format itself (templates, the
assistant's loss mask) is `gptmini.chat`."""

from gptmini.finetune.classify import (
    accuracy_and_confusion,
    add_class_head,
    class_logits,
    last_real_token,
)
from gptmini.finetune.lora import (
    DEFAULT_TARGETS,
    LORA_TARGETS,
    LoRALinear,
    adapter_state,
    add_lora,
    base_fingerprint,
    check_targets,
    count_parameters,
    lora_layers,
    merge_lora,
)
from gptmini.finetune.vocab import grow_vocab

__all__ = [
    "DEFAULT_TARGETS",
    "LORA_TARGETS",
    "LoRALinear",
    "accuracy_and_confusion",
    "adapter_state",
    "add_class_head",
    "add_lora",
    "base_fingerprint",
    "check_targets",
    "class_logits",
    "count_parameters",
    "grow_vocab",
    "last_real_token",
    "lora_layers",
    "merge_lora",
]
