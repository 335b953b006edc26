"""gptmini: a minimal GPT training framework built around one causal attention module."""

__version__ = "0.1.0"
