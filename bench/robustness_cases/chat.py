"""Chat data and templates: templates that fail by themselves (in train.py, generate.py
--chat and serve.py), loss masks that would learn the wrong tokens (a stop token written
after the last turn only; an answer spelling the stop text), tool calls, and record and
template files of a shape or syntax gptmini did not expect.

A refusal must name what it refuses (`said`: the record, the template, the file); one that
does not counts as silent."""

import json

from robustness_cases.finetune import judged
from robustness_cases.lab import Lab
from robustness_cases.serve import TINY_CHECKPOINT, Server, post

CHAT = ("--model.tokenizer", "gpt2", "--model.context_length", "64", "--model.compile", "false",
        "--trainer.max_steps", "2", "--data.loader.batch_size", "1")
TURN = [{"role": "user", "content": "Who speaks?"}, {"role": "assistant", "content": "Romeo."}]
TWO_TURNS = [*TURN, {"role": "user", "content": "And then?"},
             {"role": "assistant", "content": "Juliet."}]


def template_json(name: str, source: str) -> dict:
    """A template file as --data.chat.template takes it, with gptmini's tokens."""
    return {"name": name, "source": source, "stop": ["<|end|>"],
            "new_tokens": ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]}


LAST_ONLY = ("{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'] }}{% endfor %}"
             "{% if add_generation_prompt %}<|assistant|>{% else %}<|end|>{% endif %}")


def chat_run(records: list, *extra: str, files: dict | None = None, said: str,
             refused: bool = True, records_text: str | None = None):
    """train.py on chat records (written as .jsonl, or `records_text` as given) and `files`
    (name -> JSON-ready value or text) beside them; `{d}` in `extra` is the case's folder."""

    def case(lab: Lab):
        where = lab.folder()
        for name, content in (files or {}).items():
            (where / name).parent.mkdir(parents=True, exist_ok=True)
            (where / name).write_text(content if isinstance(content, str)
                                      else json.dumps(content))
        text = records_text or "".join(json.dumps({"messages": r}) + "\n" for r in records)
        path = where / ("records.json" if records_text else "records.jsonl")
        path.write_text(text)
        flags = [a.replace("{d}", str(where)) for a in extra]
        proc = lab.run("train.py", *lab.args(where, *CHAT, "--data.chat.records", str(path),
                                             *flags), cwd=where)
        return judged(proc, said, refused)

    return case


def broken_checkpoint(source: str) -> str:
    """TINY_CHECKPOINT carrying a chat template of `source` (gptmini's tokens unneeded)."""
    entry = {"name": "broken", "source": source, "stop": ["<|endoftext|>"]}
    return TINY_CHECKPOINT.replace("}, sys.argv[1])",
                                   f", 'chat_template': {entry!r}}}, sys.argv[1])")


def chat_command(lab: Lab):
    """generate.py --chat on a checkpoint whose template divides by zero."""
    where = lab.folder()
    lab.python(broken_checkpoint("{{ 1 / 0 }}"), str(where / "c.ckpt"), cwd=where)
    proc = lab.run("generate.py", "--checkpoint", str(where / "c.ckpt"), "--chat",
                   "--max_new_tokens", "2", cwd=where, timeout=120, input="Hello\nAgain\n")
    return judged(proc, "chat template 'broken' failed while rendering it (ZeroDivisionError")


def served_template(lab: Lab):
    """serve.py's /v1/chat/completions with that template: a 5xx naming it, no traceback."""
    server = Server(lab, broken_checkpoint("{{ 1 / 0 }}"))
    try:
        status, text = post(server.url + "/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "Hi"}]})
        logged = server.log.read_text()
    finally:
        server.stop()
    if "Traceback" in logged or (status >= 500 and "'broken'" not in text):
        return "traceback", f"{status}: {text[:100]}"
    if status < 400 or "chat template 'broken'" not in text:
        return "silent", f"{status}: {text[:100]}"
    return "clear error", f"{status} {text[:90]}"


def served_tool_calls(lab: Lab):
    """An assistant message with tool_calls: a 400 naming it, not an answer that drops it."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    status, text = post(Server.of(lab).url + "/v1/chat/completions", {"max_tokens": 2,
        "messages": [*TURN[:1], {"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "user", "content": "And?"}]})
    if status >= 500:
        return "traceback", f"{status}: {text[:100]}"
    if status != 400 or "tool_calls" not in text:
        return "silent", f"{status}, wanted a 400 naming tool_calls: {text[:90]}"
    return "clear error", f"{status} {text[:90]}"


CASES = {
    "a template dividing by zero (train.py)": chat_run(
        [TURN] * 20, "--data.chat.template", "{d}/t.json",
        files={"t.json": template_json("divides", "{{ 1 / 0 }}")},
        said="chat template 'divides' failed while rendering it (ZeroDivisionError"),
    "a template's range past the sandbox (train.py)": chat_run(
        [TURN] * 20, "--data.chat.template", "{d}/t.json",
        files={"t.json": template_json("ranges", "{% for i in range(10**9) %}{% endfor %}")},
        said="chat template 'ranges' failed while rendering it (OverflowError"),
    "a template that is not valid Jinja (train.py)": chat_run(
        [TURN] * 20, "--data.chat.template", "{d}/t.json",
        files={"t.json": template_json("unclosed", "{% for m in messages %}")},
        said="chat template 'unclosed' is not valid Jinja"),
    "generate.py --chat, a template dividing by zero": chat_command,
    "serve: a chat template dividing by zero": served_template,
    "a stop token after the last turn only": chat_run(
        [TWO_TURNS] * 20, "--data.chat.template", "{d}/t.json",
        files={"t.json": template_json("last-only", LAST_ONLY)},
        said="before messages[2] (user) begins"),
    "an answer holding the stop text <|end|>": chat_run(
        [TURN] * 19 + [[TURN[0], {"role": "assistant", "content": "Romeo <|end|> and more."}]],
        said="line 20: messages[1] (assistant) holds '<|end|>'"),
    "serve: an assistant message with tool_calls": served_tool_calls,
    "a pretty-printed JSON record as chat records": chat_run(
        [], "--data.chat.val_records", "{d}/records.json",
        records_text=json.dumps({"messages": TURN}, indent=2), said="1 training examples",
        refused=False),
    "a JSON object wrapping the records": chat_run(
        [], records_text=json.dumps({"data": [{"messages": TURN}]}, indent=2),
        said="is one JSON value (['data'])"),
    "a template .json that is not JSON": chat_run(
        [TURN] * 20, "--data.chat.template", "{d}/t.json", files={"t.json": "{not json"},
        said="t.json is not valid JSON"),
    "a model directory whose tokenizer_config.json is not JSON": chat_run(
        [TURN] * 20, "--data.chat.template", "{d}/model",
        files={"model/tokenizer_config.json": '{"chat_template": "x",}'},
        said="tokenizer_config.json is not valid JSON"),
}
