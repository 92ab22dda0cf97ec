"""The clients of a test module's `served` system (defined with tests/openai/served.py)."""

from __future__ import annotations

import openai
import pytest

from tests.openai.served import KEY


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{served.http_port}/v1", api_key=KEY, max_retries=0
    )


@pytest.fixture(scope="module")
def model(served) -> str:
    return served.model_dir.name
