"""`generate.py --chat`: a conversation with a checkpoint in the terminal.

Each line read is the user's message; the model's reply is the text the engine generates
after the conversation rendered by the model's chat template (`gptmini.finetune.chat`),
up to one of the template's stop tokens. The engine keeps the conversation's blocks in its
prefix cache, so each turn computes only its new tokens. `/reset` starts over (the system
prompt stays), `/exit` or the end of input ends. A conversation longer than the context
forgets its oldest turns.
"""

from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import TextIO

from gptmini.chat import ChatDataError, ChatTemplate, ChatTemplateError, render_chat
from gptmini.generate.engine import Engine
from gptmini.generate.sampling import SamplingParams

__all__ = ["ChatSession", "chat_loop"]

RESET, EXIT = ("/reset",), ("/exit", "/quit")


class ChatSession:
    """One conversation with `engine`'s model, rendered by `template`.

    Args:
        engine: generates the replies (one at a time; its prefix cache keeps the
            conversation so far).
        template: the model's chat template (`template_for`).
        sampling: each reply's settings; `max_new_tokens` is cut to what the context
            leaves, and a seed moves on by one each turn (the same conversation, the same
            replies).
        system: the system prompt, kept across `reset`.
    """

    def __init__(self, engine: Engine, template: ChatTemplate, sampling: SamplingParams,
                 system: str | None = None):
        self.engine, self.template, self.sampling = engine, template, sampling
        self.stop_ids = tuple(template.stop_ids(engine.tokenizer))
        self.system = [{"role": "system", "content": system}] if system else []
        self.messages: list[dict] = []
        self.turns = 0
        self.forgotten = 0
        """Messages dropped so far because the conversation outgrew the context."""

    def reset(self) -> None:
        """Forget the conversation (not the system prompt)."""
        self.messages = []

    def prompt_ids(self) -> list[int]:
        """The conversation rendered up to the assistant's opening, its oldest turns dropped
        while it leaves no room for a reply.

        Raises:
            ChatDataError: the system prompt and the last message alone do not fit.
        """
        context, kept = self.engine.context, self.messages
        while True:
            ids = render_chat(self.system + kept, self.engine.tokenizer, self.template,
                              add_generation_prompt=True, mask=False).ids
            if len(ids) < context:
                self.forgotten += len(self.messages) - len(kept)
                self.messages = kept
                return ids
            if len(kept) <= 1:
                raise ChatDataError(f"the message renders to {len(ids)} tokens with chat "
                                    f"template {self.template.name!r}, leaving no room for a "
                                    f"reply in the model's context_length of {context}; "
                                    "write a shorter one")
            kept = kept[2:]  # without the oldest user message and its reply

    def reply(self, text: str) -> Iterator[str]:
        """The model's reply to the user's `text`, piece by piece as it is generated; the
        conversation holds both once the reply is over.

        Raises:
            ChatDataError: the message does not fit the context (it is not kept).
        """
        self.messages.append({"role": "user", "content": text})
        try:
            ids = self.prompt_ids()
        except ChatDataError:
            self.messages.pop()
            raise
        seed = self.sampling.seed
        params = replace(self.sampling, stop_ids=self.stop_ids,
                         max_new_tokens=min(self.sampling.max_new_tokens,
                                            self.engine.context - len(ids)),
                         seed=None if seed is None else (seed + self.turns) % 2**63)
        self.turns += 1
        request = self.engine.add_request(ids, params)
        sent = 0
        for _ in self.engine.stream(request):
            if len(request.text) > sent:
                yield request.text[sent:]
                sent = len(request.text)
        if len(request.text) > sent:  # (bytes of a character cut by the end)
            yield request.text[sent:]
        self.messages.append({"role": "assistant", "content": request.text})


def chat_loop(session: ChatSession, lines: Iterable[str], out: TextIO,
              prompt: str = "") -> int:
    """Converse over `lines` (stdin's), writing each reply to `out` as it comes, then a
    newline; `prompt` is written before each line is read (a terminal's "> "). Returns 0.

    A message the template refuses, or one too long, is answered in parentheses and the
    conversation goes on.

    Raises:
        ChatTemplateError: the template failed by itself (every message would).
    """
    lines = iter(lines)
    while True:
        out.write(prompt)
        out.flush()
        line = next(lines, None)
        if line is None:
            break
        text = line.rstrip("\n")
        if text.strip() in EXIT:
            break
        if text.strip() in RESET:
            session.reset()
            out.write("(the conversation starts over)\n")
            continue
        if not text.strip():
            continue
        forgotten = session.forgotten
        try:
            for piece in session.reply(text):
                out.write(piece)
                out.flush()
        except ChatTemplateError:
            raise  # the template fails by itself: every message would (generate.py says so)
        except ChatDataError as err:
            out.write(f"({err})")
        if session.forgotten > forgotten:
            out.write(f"\n(the oldest {session.forgotten - forgotten} messages were "
                      "forgotten to fit the context)")
        out.write("\n")
        out.flush()
    if prompt:
        out.write("\n")
    return 0
