"""The served system an OpenAI API test module starts once: its config (the built-in model, or a
fresh tiny model behind an API key) and the app serving it."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path

from pdserve.config import ServeConfig
from tests.e2e.conftest import serve_config

KEY = "sk-openai-test"
LOW = 5  # token ids from here on are ordinary byte/merge tokens of the tiny model


def greedy(**extra) -> dict:
    """The SDK's arguments for a greedy request that ignores EOS and returns its token ids."""
    return {"temperature": 0, "extra_body": {"ignore_eos": True, "return_token_ids": True, **extra}}


def builtin_config(prefill_workers: int = 1, decode_workers: int = 1, **router) -> ServeConfig:
    """KV over grpc on loopback, the built-in model, no API key; `router` sets RouterConfig
    fields by name."""
    config = serve_config("grpc", prefill_workers=prefill_workers, decode_workers=decode_workers)
    config.router = dataclasses.replace(config.router, **router)
    return config


def keyed_config(
    tmp_path_factory,
    chat_template: str | None = None,
    prefill_workers: int = 1,
    decode_workers: int = 1,
    **router,
) -> ServeConfig:
    """A fresh tiny model behind KEY, named as the built-in model's directory (which `bench
    serve` knows the vocabulary of) or, with a family's chat template, after that family."""
    from pdserve.models.builtin import BUILTIN_VERSION, make_model
    from pdserve.models.tool_chat_templates import use_chat_template

    name = f"tiny-{chat_template or 'llama'}-v{BUILTIN_VERSION}"
    model_dir = make_model(tmp_path_factory.mktemp("model") / name)
    if chat_template:
        use_chat_template(model_dir, chat_template)
    config = builtin_config(prefill_workers, decode_workers, api_keys=[KEY], **router)
    config.engine.model = str(model_dir)
    return config


@contextlib.contextmanager
def serve(config: ServeConfig) -> Iterator:
    """The app serving `config`, with its model's directory as `model_dir`."""
    from pdserve.app import BackgroundApp
    from pdserve.models.builtin import default_model_dir

    with BackgroundApp(config) as app:
        app.model_dir = Path(config.engine.model or default_model_dir())
        yield app
