"""OpenAI request bodies → GenerateRequest (router/http/translate.py), then the gRPC API's
validation: pdserve's extra body fields arrive in SamplingParams."""

from __future__ import annotations

import asyncio

from router.http.schemas import ChatCompletionRequest, CompletionRequest
from router.http.translate import generate_request
from router.validation import ModelLimits, validate

LIMITS = ModelLimits(name="tiny", vocab_size=512, max_model_len=256, eos_token_ids=[1])


async def _tokenize(text: str) -> list[int]:
    return [2 + b for b in text.encode()]


def _sampling(body, prompt="hello"):
    request = generate_request(body, prompt)
    return asyncio.run(validate(request, LIMITS, _tokenize)).sampling


def test_disable_speculation_is_an_extra_body_field() -> None:
    plain = CompletionRequest(model="tiny", prompt="hello")
    opted_out = CompletionRequest(model="tiny", prompt="hello", disable_speculation=True)
    chat = ChatCompletionRequest.model_validate(
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "disable_speculation": 1}
    )
    assert _sampling(plain).speculative
    assert not _sampling(opted_out).speculative
    assert not _sampling(chat, [5, 6]).speculative
