"""Chat templates: identical ids to `transformers`' `apply_chat_template` on a fixed set of
conversations, the assistant's mask checked against the text each message should train,
the one "auto" rule, and errors that name the record and the field."""

import json

import pytest
import tiktoken

from gptmini.chat import (
    BOOK,
    GPTMINI,
    ChatDataError,
    ChatTemplate,
    add_template_tokens,
    choose_template,
    directory_template,
    render_chat,
    template_for,
)
from gptmini.tokenizer import (
    get_tokenizer,
    split_pattern,
    tiktoken_ranks,
    to_hf_tokenizer,
    train_bpe,
)

# Written for these tests in the formats of Llama 3.1's and Qwen3's templates: Llama's
# header tokens, its trimmed contents, its default date; Qwen's ChatML and its empty
# thinking block on the assistant's answer to the last question. The generation prompt's
# tags are indented and undashed, so rendering without trim_blocks or lstrip_blocks fails.
LLAMA3_STYLE = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {{- message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
    {% if add_generation_prompt %}
{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
    {%- endif %}
"""

QWEN3_STYLE = """{%- set ns = namespace(last_query=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- set ns.last_query = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'assistant' %}
        {%- set content = message.content %}
        {%- if loop.index0 > ns.last_query and loop.last %}
            {{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

SYSTEM = {"role": "system", "content": "You are terse."}
CONVERSATIONS = {
    "system": [SYSTEM, {"role": "user", "content": "Name a colour."},
               {"role": "assistant", "content": "Blue."}],
    "multi-turn": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                   {"role": "user", "content": "What is 2 + 2?"},
                   {"role": "assistant", "content": "Four, as ever.\n"}],
    "empty content": [SYSTEM, {"role": "user", "content": ""},
                      {"role": "assistant", "content": ""}],
    "unicode": [{"role": "user", "content": "Ünïcödé — 東京 🚀, naïve café?"},
                {"role": "assistant", "content": " Ça va: 日本語 ✓ "}],
    "two assistants": [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1"},
                       {"role": "assistant", "content": "2"}],
}
TEXT = ("To be, or not to be, that is the question. Whether 'tis nobler in the mind to suffer "
        "the slings and arrows of outrageous fortune. Ünïcödé 東京 naïve café colour blue. ") * 3


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    """A tokenizer directory as Hugging Face saves one: tokenizer.json of a small fitted
    BPE with Llama 3's and Qwen3's special tokens, and a tokenizer_config.json."""
    base = train_bpe([TEXT], 320)
    names = ["<|endoftext|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
             "<|eot_id|>", "<|im_start|>", "<|im_end|>"]
    ranks = tiktoken_ranks(base)
    enc = tiktoken.Encoding(name="chat-test", pat_str=split_pattern(base), mergeable_ranks=ranks,
                            special_tokens={t: len(ranks) + i for i, t in enumerate(names)})
    directory = tmp_path_factory.mktemp("chat")
    (directory / "tokenizer.json").write_text(json.dumps(to_hf_tokenizer(enc)))
    return directory, enc


def hf_tokenizer(directory, source: str, eos: str, bos: str = "<|begin_of_text|>"):
    transformers = pytest.importorskip("transformers")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": source,
              "bos_token": bos, "eos_token": eos}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return transformers.AutoTokenizer.from_pretrained(directory)


def their_ids(hf, messages, prompt: bool) -> list[int]:
    return list(hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=prompt,
                                       return_dict=False))


TEMPLATE_CASES = {  # name: (source, eos, what each assistant message trains, given content)
    "llama3": (LLAMA3_STYLE, "<|eot_id|>", lambda c, last: c.strip() + "<|eot_id|>"),
    "qwen3": (QWEN3_STYLE, "<|im_end|>",
              lambda c, last: ("<think>\n\n</think>\n\n" + c.lstrip("\n") if last else c)
              + "<|im_end|>"),
    "gptmini": (GPTMINI.source, "<|end|>", lambda c, last: c + "<|end|>"),
    "book": (BOOK.source, "<|endoftext|>", lambda c, last: c + "<|endoftext|>"),
}


def trained_texts(enc, rendered) -> list[str]:
    """The text of each run of True in the mask."""
    runs, current = [], None
    for token, keep in zip(rendered.ids, rendered.assistant_mask, strict=True):
        if keep:
            current = (current or []) + [token]
        elif current is not None:
            runs.append(enc.decode(current))
            current = None
    return runs + ([enc.decode(current)] if current else [])


def test_templates_render_the_ids_transformers_renders_and_mask_the_assistants_text(chat_dir):
    """0 mismatches on the fixed set: each template x conversation x generation prompt, the
    ids equal apply_chat_template's (the identity goal); the mask's runs decode to what
    each assistant message should train (its content and its stop token), by an oracle
    written from the template's format, not from the renderer."""
    directory, enc = chat_dir
    mismatches, checked = [], 0
    for name, (source, eos, expected) in TEMPLATE_CASES.items():
        if name == "gptmini":  # gptmini's tokens join the vocabulary; save it again
            tokenizer = add_template_tokens(enc, GPTMINI)
            sub = directory / "gptmini"
            sub.mkdir(exist_ok=True)
            (sub / "tokenizer.json").write_text(json.dumps(to_hf_tokenizer(tokenizer)))
        else:
            tokenizer, sub = enc, directory
        hf = hf_tokenizer(sub, source, eos)
        template = directory_template(sub, tokenizer)
        assert template.stop == (eos,)
        for case, messages in CONVERSATIONS.items():
            for prompt in (False, True):
                mine = render_chat(messages, tokenizer, template, add_generation_prompt=prompt,
                                   mask=False)
                checked += 1
                if mine.ids != their_ids(hf, messages, prompt):
                    mismatches.append((name, case, prompt))
                if name == "qwen3" and case == "two assistants":
                    # Qwen3 renders the first differently once the second follows it
                    with pytest.raises(ChatDataError, match="two assistant messages in a row"):
                        render_chat(messages, tokenizer, template)
                    continue
                mine = render_chat(messages, tokenizer, template, add_generation_prompt=prompt)
                assert not any(mine.assistant_mask[len(their_ids(hf, messages, False)):])
                assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
                want = [expected(messages[i]["content"], i == len(messages) - 1)
                        for i in assistants]
                assert trained_texts(tokenizer, mine) == want, (name, case)
    assert checked == 40
    assert mismatches == []


def test_the_generation_prompt_opens_the_turn_the_mask_starts_after(chat_dir):
    _, enc = chat_dir
    tokenizer = add_template_tokens(enc, GPTMINI)
    history = CONVERSATIONS["system"]
    prompt = render_chat(history[:2], tokenizer, GPTMINI, add_generation_prompt=True)
    whole = render_chat(history, tokenizer, GPTMINI)
    assert whole.ids[:len(prompt.ids)] == prompt.ids
    assert not any(whole.assistant_mask[:len(prompt.ids)])
    assert all(whole.assistant_mask[len(prompt.ids):])
    assert GPTMINI.stop_ids(tokenizer) == [whole.ids[-1]]


def test_targets_are_minus_100_except_where_the_assistant_wrote_the_next_token():
    tokenizer = add_template_tokens(get_tokenizer("byte"), GPTMINI)
    rendered = render_chat(CONVERSATIONS["multi-turn"], tokenizer, GPTMINI)
    inputs, targets = rendered.inputs_and_targets()
    assert len(inputs) == len(targets) == len(rendered.ids) - 1
    kept = bytes(t for t in targets if 0 <= t < 256).decode()
    assert kept == "Hello.Four, as ever.\n"
    assert targets.count(tokenizer.encode_single_token("<|end|>")) == 2


def test_template_for_picks_the_checkpoints_then_gptminis_then_the_books():
    byte = get_tokenizer("byte")
    assert template_for(byte) is BOOK
    assert template_for(add_template_tokens(byte, GPTMINI)) is GPTMINI
    own = ChatTemplate("mine", "{{ messages[0]['content'] }}", ("<|endoftext|>",))
    assert template_for(byte, {"chat_template": own.to_dict()}) == own


@pytest.mark.parametrize(("messages", "message"), [
    ([], "'messages' must be a non-empty list"),
    ("hello", "'messages' must be a non-empty list"),
    ([{"content": "hi"}], r"messages\[0\] has no 'role'"),
    ([{"role": "robot", "content": "hi"}], r"messages\[0\].role is \"robot\": use one of"),
    ([{"role": "user", "content": 3}], r"messages\[0\].content must be a string"),
    ([{"role": "user", "content": "a\ud800"}], r"messages\[0\].content cannot be encoded"),
    (["hi"], r"messages\[0\] must be an object"),
])
def test_bad_messages_are_refused_naming_the_record_and_the_field(messages, message):
    byte = add_template_tokens(get_tokenizer("byte"), GPTMINI)
    with pytest.raises(ChatDataError, match=f"^train.jsonl line 7: {message}"):
        render_chat(messages, byte, GPTMINI, where="train.jsonl line 7")


def test_a_template_the_tokenizer_cannot_encode_is_refused():
    with pytest.raises(ChatDataError, match=r"cannot be encoded by tokenizer 'byte': it has no "
                                            r"special token <\|system\|>.*add_template_tokens"):
        render_chat(CONVERSATIONS["system"], get_tokenizer("byte"), GPTMINI)


def test_auto_is_one_rule_the_source_models_template_first_then_one_for_the_records(tmp_path):
    gpt2 = get_tokenizer("gpt2")
    own = ChatTemplate(name="theirs", source=GPTMINI.source, stop=("<|endoftext|>",))
    assert choose_template("auto", gpt2, alpaca=True) is BOOK
    assert choose_template("auto", gpt2, alpaca=False) is GPTMINI
    # a source model's own template wins over the records' kind, both kinds
    assert choose_template("auto", gpt2, alpaca=True, source=own) is own
    assert choose_template("auto", gpt2, alpaca=False, source=own) is own
    # a named template is that template, whatever the source has
    assert choose_template("book", gpt2, alpaca=False, source=own) is BOOK
    saved = tmp_path / "t.json"
    saved.write_text(json.dumps(own.to_dict()))
    assert choose_template(str(saved), gpt2, alpaca=True) == own
    with pytest.raises(ValueError, match="chat template 'chatml': use auto, gptmini, book"):
        choose_template("chatml", gpt2, alpaca=True)
