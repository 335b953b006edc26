"""Fine-tuning a pretrained GPT: chat templates and the assistant's loss mask (chat.py), LoRA
adapters (lora.py) and a class head read at each sequence's last real token (classify.py).
Imports only torch, the model and the tokenizer."""

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
    count_parameters,
    lora_layers,
    merge_lora,
)

__all__ = [
    "DEFAULT_TARGETS",
    "LORA_TARGETS",
    "LoRALinear",
    "accuracy_and_confusion",
    "adapter_state",
    "add_class_head",
    "add_lora",
    "base_fingerprint",
    "class_logits",
    "count_parameters",
    "last_real_token",
    "lora_layers",
    "merge_lora",
]
