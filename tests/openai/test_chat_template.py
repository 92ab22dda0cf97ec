"""Chat templates render exactly as transformers' apply_chat_template renders them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.models.tokenizer_builder import write_tokenizer
from pdserve.tokenizer import Tokenizer
from router.http.chat_template import ChatTemplate, ChatTemplateError

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}"
    "{% endif %}{% endfor %}"
)
QWEN2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Multi-line, in the Llama-3.1 style: whitespace control, trim_blocks/lstrip_blocks, namespace,
# loop controls, tojson and strftime_now all matter to the output.
LLAMA31_STYLE = """{{- bos_token }}
{%- set date_string = strftime_now("%d %b %Y") %}
{%- set ns = namespace(system="", turns=0) %}
{%- if messages[0]['role'] == 'system' %}
    {%- set ns.system = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- endif %}
<|start_header_id|>system<|end_header_id|>

Today Date: {{ date_string }}
{{ ns.system }}
{% if meta is defined %}
Meta: {{ meta | tojson }}
{% endif %}
<|eot_id|>
{% for message in messages %}
    {% if message['role'] == 'tool' %}{% continue %}{% endif %}
    {% set ns.turns = ns.turns + 1 %}
    <|start_header_id|>{{ message['role'] }}<|end_header_id|>

{{ message['content'] | trim }}<|eot_id|>
    {% if ns.turns > 5 %}{% break %}{% endif %}
{% endfor %}
{%- if add_generation_prompt %}
<|start_header_id|>assistant<|end_header_id|>

{% endif %}
"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hello there!"}],
    [
        {"role": "system", "content": '  Be brief. <tag> & "quotes" '},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Naïve café — 日本語 🙂"},
    ],
    [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "second", "reasoning_content": None},
        {"role": "user", "content": "third"},
    ],
]


def model_dir(tmp_path: Path, template: str | None) -> Path:
    write_tokenizer(tmp_path, 512)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    if template is None:
        config.pop("chat_template", None)
    else:
        config["chat_template"] = template
    config_path.write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("template", [LLAMA3, MISTRAL, QWEN2, LLAMA31_STYLE])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_rendering_matches_transformers(tmp_path, template, generation_prompt) -> None:
    from transformers import AutoTokenizer

    directory = model_dir(tmp_path, template)
    reference = AutoTokenizer.from_pretrained(directory)
    ours = ChatTemplate.from_dir(directory)
    tokenizer = Tokenizer.from_dir(directory)
    rendered = 0
    for conversation in CONVERSATIONS:
        if template == MISTRAL and conversation[0]["role"] == "system":
            continue  # the Mistral template refuses system messages (checked below)
        expected = reference.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=generation_prompt
        )
        text = ours.render(conversation, add_generation_prompt=generation_prompt)
        assert text == expected
        expected_ids = reference.apply_chat_template(
            conversation, tokenize=True, add_generation_prompt=generation_prompt
        )
        if isinstance(expected_ids, dict) or hasattr(expected_ids, "keys"):
            expected_ids = expected_ids["input_ids"]
        assert tokenizer.encode(text, add_special_tokens=False) == list(expected_ids)
        rendered += 1
    assert rendered >= 2


def test_template_variables_reach_the_template(tmp_path) -> None:
    from transformers import AutoTokenizer

    directory = model_dir(tmp_path, LLAMA31_STYLE)
    conversation = CONVERSATIONS[0]
    meta = {"html": "<b>&</b>", "n": [1, 2]}
    expected = AutoTokenizer.from_pretrained(directory).apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=True, meta=meta
    )
    assert "<b>&</b>" in expected  # tojson leaves HTML alone
    assert ChatTemplate.from_dir(directory).render(conversation, meta=meta) == expected


def test_raise_exception_in_a_template_is_a_chat_template_error(tmp_path) -> None:
    template = ChatTemplate.from_dir(model_dir(tmp_path, MISTRAL))
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        template.render([{"role": "system", "content": "x"}, {"role": "user", "content": "y"}])


def test_a_template_cannot_reach_python_internals(tmp_path) -> None:
    template = ChatTemplate("{{ messages.__class__.__mro__ }}{{ dict.mro() }}", {})
    with pytest.raises(ChatTemplateError):
        template.render([{"role": "user", "content": "x"}])


def test_no_template_gives_none(tmp_path) -> None:
    assert ChatTemplate.from_dir(model_dir(tmp_path, None)) is None


def test_make_model_writes_a_template_transformers_renders_the_same(tmp_path) -> None:
    from transformers import AutoTokenizer

    write_tokenizer(tmp_path, 512)
    conversation = CONVERSATIONS[1]
    expected = AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=True
    )
    text = ChatTemplate.from_dir(tmp_path).render(conversation)
    assert text == expected
    assert text.startswith("<s>system: ") and text.endswith(
        "4</s>\nuser: Naïve café — 日本語 🙂\nassistant: "
    )
    ids = Tokenizer.from_dir(tmp_path).encode(text, add_special_tokens=False)
    assert ids[0] == 0 and ids.count(1) == 1  # <s> and </s> are the special tokens
