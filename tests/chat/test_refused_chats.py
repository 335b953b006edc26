"""What gptmini cannot render right is refused, naming the record, the template or the file
(issue 48's hostile findings): a template that fails by itself, a template whose stop token
comes only after the last turn (the mask would learn the user's words), an answer that
spells the stop token (the rest would never be learned), tool calls, and files that are JSON
of another shape or no JSON at all."""

import json

import pytest

from gptmini.chat import (
    GPTMINI,
    ChatDataError,
    ChatTemplate,
    ChatTemplateError,
    add_template_tokens,
    directory_template,
    load_template,
    read_records,
    render_chat,
)
from gptmini.tokenizer import get_tokenizer

ENC = add_template_tokens(get_tokenizer("byte"), GPTMINI)
USER = {"role": "user", "content": "q1"}
TWO_TURNS = [USER, {"role": "assistant", "content": "a1"},
             {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]


def template(name: str, source: str) -> ChatTemplate:
    return ChatTemplate(name, source, stop=("<|end|>",))


@pytest.mark.parametrize(("source", "error"), [
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{% for i in range(10**9) %}{% endfor %}", "OverflowError"),  # the sandbox's limit
])
def test_a_template_that_fails_by_itself_is_named_with_its_error(source, error):
    with pytest.raises(ChatTemplateError, match=f"chat template 'broken' failed while "
                                                f"rendering it \\({error}"):
        render_chat([USER], ENC, template("broken", source), where="train.jsonl line 3")
    with pytest.raises(ChatTemplateError, match="'unclosed' is not valid Jinja"):
        render_chat([USER], ENC, template("unclosed", "{% for m in messages %}"))


def test_a_stop_token_only_after_the_last_turn_is_refused_naming_the_turn_it_would_learn():
    # Its mask would run from the first answer to the one stop token at the end: the
    # user's second message taught as the assistant's words.
    last_only = template("last-only", "{% for m in messages %}{{ '<|' + m['role'] + '|>' + "
                         "m['content'] }}{% endfor %}{% if add_generation_prompt %}"
                         "<|assistant|>{% else %}<|end|>{% endif %}")
    with pytest.raises(ChatDataError, match=r"r.jsonl line 2: messages\[1\] \(assistant\) is "
                       r"not ended by a stop token .* before messages\[2\] \(user\) begins"):
        render_chat(TWO_TURNS, ENC, last_only, where="r.jsonl line 2")
    # the same template renders a single answer, which its stop does end, as before
    one = render_chat(TWO_TURNS[:2], ENC, last_only)
    assert ENC.decode([t for t, m in zip(one.ids, one.assistant_mask, strict=True) if m]) == (
        "a1<|end|>")
    # and gptmini's own masks both answers alone
    both = render_chat(TWO_TURNS, ENC, GPTMINI)
    assert ENC.decode([t for t, m in zip(both.ids, both.assistant_mask, strict=True) if m]) == (
        "a1<|end|>a2<|end|>")


def test_an_answer_spelling_the_stop_token_is_refused_for_training_and_rendered_for_serving():
    said = [USER, {"role": "assistant", "content": "Type <|end|> to finish the form."}]
    with pytest.raises(ChatDataError, match=r"r.jsonl line 7: messages\[1\] \(assistant\) "
                       r"holds '<\|end\|>'.* 20 characters before the answer ends"):
        render_chat(said, ENC, GPTMINI, where="r.jsonl line 7")
    render_chat(said, ENC, GPTMINI, mask=False)  # a served conversation renders as given


@pytest.mark.parametrize("field", ["tool_calls", "function_call"])
def test_tool_calls_are_refused_not_dropped(field):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [USER, {"role": "assistant", "content": None,
                       field: [call] if field == "tool_calls" else call["function"]}]
    with pytest.raises(ChatDataError, match=rf"messages\[1\].{field}: tool calls are not "
                                            "supported"):
        render_chat(messages, ENC, GPTMINI, mask=False)
    # what clients send for "no tool calls" is not a tool call
    render_chat([USER, {"role": "assistant", "content": "a", "tool_calls": []}], ENC, GPTMINI)


def test_a_pretty_printed_record_is_one_record_and_a_wrapper_is_named(tmp_path):
    record = {"messages": [USER, {"role": "assistant", "content": "a1"}]}
    path = tmp_path / "one.json"
    path.write_text(json.dumps(record, indent=2))
    assert read_records(path) == [(f"{path} line 1", record)]
    wrapper = tmp_path / "wrapped.json"
    wrapper.write_text(json.dumps({"data": [record]}, indent=2))
    with pytest.raises(ValueError, match=r"wrapped.json is one JSON value \(\['data'\]\), not "
                                         r"chat records: give a JSON list"):
        read_records(wrapper)


def test_malformed_template_files_are_named(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "x",}')
    with pytest.raises(ValueError, match=r"tokenizer_config.json is not valid JSON \(.*line 1 "
                                         r"column 23\)"):
        directory_template(tmp_path, ENC)
    saved = tmp_path / "template.json"
    saved.write_text("{not json")
    with pytest.raises(ValueError, match=r"^\S*template.json is not valid JSON \(Expecting "
                                         "property name"):
        load_template(str(saved), ENC)
