"""Fine-tuning: chat templates and the assistant's loss mask (chat.py)."""
