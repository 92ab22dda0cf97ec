"""The official `openai` SDK's chat completions against the served system (tests/openai/sdk/
conftest.py): the model's template rendered, the gRPC tokens, async streams that reassemble to
whole responses."""

from __future__ import annotations

import asyncio

import openai

from pdserve.tokenizer import Tokenizer
from router.http.chat_template import ChatTemplate
from tests.openai.served import KEY, greedy


def test_chat_renders_the_template_and_gives_the_grpc_tokens(served, client, grpc_client, model):
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}],
        },
    ]
    response = client.chat.completions.create(
        model=model, messages=messages, max_completion_tokens=10, **greedy()
    )
    rendered = ChatTemplate.from_dir(served.model_dir).render(
        [messages[0], {"role": "user", "content": "Hello\nthere"}]
    )
    prompt_ids = Tokenizer.from_dir(served.model_dir).encode(rendered, add_special_tokens=False)
    expected = grpc_client.generate(prompt_ids, max_tokens=10, ignore_eos=True)
    choice = response.choices[0]
    assert choice.prompt_token_ids == prompt_ids
    assert choice.token_ids == expected.token_ids
    assert choice.message.role == "assistant" and choice.message.content == expected.text
    assert response.object == "chat.completion" and response.usage.completion_tokens == 10


def test_async_chat_streams_reassemble_to_whole_responses(served, model):
    async def main() -> None:
        client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{served.http_port}/v1", api_key=KEY, max_retries=0
        )
        questions = [f"question number {i}?" for i in range(4)]

        async def both(question: str) -> tuple[str, str, str | None]:
            messages = [{"role": "user", "content": question}]
            whole = await client.chat.completions.create(
                model=model, messages=messages, max_tokens=8, **greedy()
            )
            stream = await client.chat.completions.create(
                model=model, messages=messages, max_tokens=8, stream=True, **greedy()
            )
            chunks = [chunk async for chunk in stream]
            assert chunks[0].choices[0].delta.role == "assistant"
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            return whole.choices[0].message.content, text, chunks[-1].choices[0].finish_reason

        results = await asyncio.gather(*(both(q) for q in questions))
        for whole, streamed, finish in results:
            assert streamed == whole and finish == "length"
        await client.close()

    asyncio.run(main())
