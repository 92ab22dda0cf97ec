"""Chat templates: a model directory's `chat_template` rendered as transformers renders it.

`apply_chat_template` compiles the template in a sandboxed jinja2 environment with
trim_blocks/lstrip_blocks and the loopcontrols extension, adds `raise_exception`,
`strftime_now`, a `tojson` that does not escape HTML, and renders it with the messages (None
values dropped), `add_generation_prompt` and the special tokens (`bos_token`, `eos_token`, ...)
as variables. The same here, so a prompt is the one the model was trained on; the rendered text
is tokenized without adding special tokens (the template writes them).

A message whose content is a list of parts (OpenAI's `[{"type": "text", "text": ...}]`) reaches
the template as that list, as transformers passes it, when the template iterates a message's
content (`content_format` "openai", found in the template's syntax tree, the test vLLM's
`_detect_content_format` makes). A template that only reads content as a string (most text
models': `'[INST] ' + message['content']`) gets the text parts joined by newlines, the one form
it can render; given the list, transformers' own rendering fails or prints the list's repr.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class ChatTemplateError(ValueError):
    """The template refused the conversation (`raise_exception`) or failed to render."""


class _Namespace(jinja2.utils.Namespace):
    """jinja2's namespace() without underscore-prefixed attributes (no way to CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore-prefixed attributes, got {name!r}"
            )


class _Dict:
    """`dict` for templates, callable and with `fromkeys`, but not the type itself: no route
    through its class attributes."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env.from_string(source)


class ChatTemplate:
    """`ChatTemplate.from_dir(model_dir)` (None when the model has no template), then
    `render(messages)`."""

    def __init__(self, source: str, special_tokens: Mapping[str, str]) -> None:
        self.source = source
        self.special_tokens = dict(special_tokens)
        self._template = compile_template(source)
        self.content_format = content_format(source)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ChatTemplate | None:
        config_path = Path(model_dir) / "tokenizer_config.json"
        if not config_path.is_file():
            return None
        config = json.loads(config_path.read_text(encoding="utf-8"))
        source = config.get("chat_template")
        if isinstance(source, list):  # named templates: transformers uses "default"
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        if not source:
            return None
        tokens = _special_tokens(Path(model_dir) / "special_tokens_map.json")
        tokens.update(_special_tokens_of(config))
        return cls(source, tokens)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **variables: Any,
    ) -> str:
        """The conversation as prompt text (with the tools the model may call, as
        transformers' `tools=` passes them); ChatTemplateError with the template's message when
        it refuses the conversation."""
        chat = [
            _alias_reasoning(self._content_as_template_takes_it(message)) for message in messages
        ]
        try:
            return self._template.render(
                messages=chat,
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens, **variables},
            )
        except Exception as e:  # messages of a shape the template did not expect, too
            raise ChatTemplateError(str(e) or type(e).__name__) from e

    def _content_as_template_takes_it(self, message: Mapping[str, Any]) -> dict[str, Any]:
        """The message without None values; list content joined into one string for a
        template that reads content only as a string."""
        fields = {k: v for k, v in message.items() if v is not None}
        content = fields.get("content")
        if self.content_format == "string" and isinstance(content, list):
            fields["content"] = "\n".join(part["text"] for part in content if "text" in part)
        return fields


def content_format(source: str) -> str:
    """ "openai" when the template loops over a message's content (it takes the list of parts),
    else "string". Found in the syntax tree: the names bound to the messages list (`messages`
    and what `set` derives from it), the loop variables over those (a message), and a loop
    whose iterable is a message's `content` (or a name set to it)."""
    tree = jinja2.Environment(extensions=[jinja2.ext.loopcontrols]).parse(source)
    loops = list(tree.find_all(jinja2.nodes.For))
    assigns = list(tree.find_all(jinja2.nodes.Assign))
    lists, messages, contents = {"messages"}, set(), set()
    while True:  # until no new name: a set or loop may come before the one it reads from
        size = len(lists) + len(messages) + len(contents)
        for node in assigns:
            if isinstance(node.target, jinja2.nodes.Name):
                value = _underlying(node.node)
                if _is_name_in(value, lists):
                    lists.add(node.target.name)
                elif _is_content(value, messages, lists):
                    contents.add(node.target.name)
                elif _is_message(value, messages, lists):
                    messages.add(node.target.name)
        for loop in loops:
            if isinstance(loop.target, jinja2.nodes.Name) and _is_name_in(
                _underlying(loop.iter), lists
            ):
                messages.add(loop.target.name)
        if len(lists) + len(messages) + len(contents) == size:
            break
    for loop in loops:
        iterable = _underlying(loop.iter)
        if _is_content(iterable, messages, lists) or _is_name_in(iterable, contents):
            return "openai"
    return "string"


def _underlying(node: jinja2.nodes.Node) -> jinja2.nodes.Node:
    """The expression under filters and slices: `messages[1:] | selectattr(...)` -> messages."""
    while _wraps(node):
        node = node.node
    return node


def _wraps(node: jinja2.nodes.Node) -> bool:
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None
    return isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice)


def _is_name_in(node: jinja2.nodes.Node, names: set[str]) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.name in names


def _is_message(node: jinja2.nodes.Node, messages: set[str], lists: set[str]) -> bool:
    """A loop variable over the messages, or one message indexed (`messages[0]`)."""
    if _is_name_in(node, messages):
        return True
    return isinstance(node, jinja2.nodes.Getitem) and _is_name_in(_underlying(node.node), lists)


def _is_content(node: jinja2.nodes.Node, messages: set[str], lists: set[str]) -> bool:
    """`message['content']` or `message.content` of a message."""
    if isinstance(node, jinja2.nodes.Getitem):
        key = node.arg
        is_content = isinstance(key, jinja2.nodes.Const) and key.value == "content"
    elif isinstance(node, jinja2.nodes.Getattr):
        is_content = node.attr == "content"
    else:
        return False
    return is_content and _is_message(node.node, messages, lists)


# A message's reasoning under each name templates read it by; the first is the standard one.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _special_tokens(path: Path) -> dict[str, str]:
    if not path.is_file():
        return {}
    return _special_tokens_of(json.loads(path.read_text(encoding="utf-8")))


def _special_tokens_of(config: Mapping[str, Any]) -> dict[str, str]:
    tokens = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if isinstance(value, Mapping):  # an AddedToken written out: {"content": ..., ...}
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return tokens
