"""Checkpoints: the format, written and read in one place (format.py), and files written
whole or not at all (atomic.py, Lightning's CheckpointIO; imported by training only)."""

from gptmini.checkpoint.format import (
    CONFIG_FIELDS,
    MODEL_PREFIX,
    LoadedModel,
    check_readable,
    load_checkpoint,
    load_on_device,
    model_config,
    model_source,
    read_checkpoint,
    tokenizer_entry,
    training_steps,
    write_model_entries,
)

__all__ = ["CONFIG_FIELDS", "MODEL_PREFIX", "LoadedModel", "check_readable", "load_checkpoint",
           "load_on_device", "model_config", "model_source", "read_checkpoint", "tokenizer_entry",
           "training_steps", "write_model_entries"]
