"""The chat format: templates, rendering a conversation to ids, the assistant's loss mask,
and reading chat and instruction records.

A library below data/, generation and serving: it imports the tokenizer and no model, no
torch, no training code, so reading records or rendering a prompt loads none of them
(tests/chat/test_chat_imports.py holds it to that).

    templates.py  ChatTemplate, gptmini's and the book's, a model directory's; the "auto" rule
    render.py     render_chat: ids as `transformers` renders them, and the assistant's mask
    records.py    chat and Alpaca records from .jsonl/.json, each as messages
"""

from gptmini.chat.records import BOOK_RECORDS, is_alpaca, read_records, to_messages
from gptmini.chat.render import ROLES, RenderedChat, check_messages, render_chat
from gptmini.chat.templates import (
    AUTO,
    BOOK,
    BOOK_PREAMBLE,
    GPTMINI,
    TEMPLATES,
    ChatDataError,
    ChatTemplate,
    ChatTemplateError,
    add_template_tokens,
    choose_template,
    directory_template,
    load_template,
    settings_template,
    template_for,
)

__all__ = [
    "AUTO",
    "BOOK",
    "BOOK_PREAMBLE",
    "BOOK_RECORDS",
    "GPTMINI",
    "ROLES",
    "TEMPLATES",
    "ChatDataError",
    "ChatTemplate",
    "ChatTemplateError",
    "RenderedChat",
    "add_template_tokens",
    "check_messages",
    "choose_template",
    "directory_template",
    "is_alpaca",
    "load_template",
    "read_records",
    "render_chat",
    "settings_template",
    "template_for",
    "to_messages",
]
