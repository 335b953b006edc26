"""Checkpoints: the format, written and read in one place (format.py), sharded checkpoints
read whole (sharded.py; `python -m gptmini.checkpoint consolidate`), and files written whole
or not at all (atomic.py, Lightning's CheckpointIO; imported by training only)."""

from gptmini.checkpoint.format import (
    CONFIG_FIELDS,
    MODEL_PREFIX,
    LoadedModel,
    check_readable,
    gguf_source,
    load_checkpoint,
    load_on_device,
    model_config,
    model_source,
    read_checkpoint,
    run_data_settings,
    tokenizer_entry,
    training_steps,
    write_model_entries,
)
from gptmini.checkpoint.sharded import consolidate, is_sharded

__all__ = ["CONFIG_FIELDS", "MODEL_PREFIX", "LoadedModel", "check_readable", "consolidate",
           "gguf_source", "is_sharded", "load_checkpoint",
           "load_on_device", "model_config", "model_source", "read_checkpoint",
           "run_data_settings", "tokenizer_entry",
           "training_steps", "write_model_entries"]
