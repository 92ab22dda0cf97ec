"""Chat content given as a list of parts renders as transformers' apply_chat_template renders it:
the list itself for a template that iterates a message's content, the text parts joined by
newlines for one that reads content only as a string (given the list, that template fails or
prints its repr in transformers too). Every template style of the test models, with string and
list content, byte for byte."""

from __future__ import annotations

import pytest

from pdserve.models.tokenizer_builder import CHAT_TEMPLATE
from router.http.chat_template import ChatTemplate
from router.http.schemas import ChatCompletionRequest
from router.http.translate import chat_messages
from tests.openai.test_chat_template import LLAMA3, LLAMA31_STYLE, MISTRAL, QWEN2, model_dir

# Templates that take the list, in the styles of Qwen2-VL (either form, by `is string`),
# Llama-3.2-Vision (the system message taken off first, parts filtered by type) and a style
# that names the content before looping over it.
QWEN2_VL_STYLE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}"
    "<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA32_VISION_STYLE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{%- if system_message is not string %}
    {%- set system_message = system_message | map(attribute='text') | join(' ') %}
{%- endif %}
<|start_header_id|>system<|end_header_id|>

{{ system_message | trim }}<|eot_id|>
{%- for message in messages %}
<|start_header_id|>{{ message['role'] }}<|end_header_id|>

{% if message['content'] is string %}
{{- message['content'] | trim }}
{%- else %}
{%- for content in message['content'] | selectattr('type', 'equalto', 'text') %}
{{- content['text'] | trim }}
{%- endfor %}
{%- endif %}
<|eot_id|>
{%- endfor %}
{%- if add_generation_prompt %}
<|start_header_id|>assistant<|end_header_id|>

{% endif %}
"""
NAMED_PARTS_STYLE = (
    "{% set loop_messages = messages %}{% for turn in loop_messages %}"
    "{% set parts = turn.content %}<{{ turn.role }}>"
    "{% if parts is string %}{{ parts }}{% else %}{% for part in parts %}[{{ part.text }}]"
    "{% endfor %}{% endif %}</{{ turn.role }}>{% endfor %}"
)

STYLES = {
    "make-model": (CHAT_TEMPLATE, "string"),
    "llama3": (LLAMA3, "string"),
    "mistral": (MISTRAL, "string"),
    "qwen2": (QWEN2, "string"),
    "llama3.1": (LLAMA31_STYLE, "string"),
    "qwen2-vl": (QWEN2_VL_STYLE, "openai"),
    "llama3.2-vision": (LLAMA32_VISION_STYLE, "openai"),
    "named-parts": (NAMED_PARTS_STYLE, "openai"),
}

AS_STRINGS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello\nthere"},
    {"role": "assistant", "content": "Hi!"},
    {"role": "user", "content": "Naïve café — 日本語 🙂"},
]
AS_PARTS = [
    {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
    {
        "role": "user",
        "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}],
    },
    {"role": "assistant", "content": "Hi!"},
    {"role": "user", "content": [{"type": "text", "text": "Naïve café — 日本語 🙂"}]},
]


@pytest.mark.parametrize("style", list(STYLES))
def test_string_and_list_content_render_as_transformers_renders_them(tmp_path, style) -> None:
    from transformers import AutoTokenizer

    source, kind = STYLES[style]
    directory = model_dir(tmp_path, source)
    reference = AutoTokenizer.from_pretrained(directory)
    ours = ChatTemplate.from_dir(directory)
    assert ours.content_format == kind
    # The Mistral template refuses a system message: its conversations start with the user.
    first = 1 if style == "mistral" else 0
    strings, parts = AS_STRINGS[first:], AS_PARTS[first:]
    expected = reference.apply_chat_template(strings, tokenize=False, add_generation_prompt=True)
    assert ours.render(strings) == expected
    # A template that takes the list gets it, as transformers passes it; one that reads content
    # as a string gets the joined text, which is the string conversation.
    # The request's way there: the HTTP body's messages, then the template.
    given = parts if kind == "openai" else strings
    expected = reference.apply_chat_template(given, tokenize=False, add_generation_prompt=True)
    text = ours.render(chat_messages(ChatCompletionRequest(model="m", messages=parts)))
    assert text == expected
    assert "Hello" in text and "Naïve café" in text
