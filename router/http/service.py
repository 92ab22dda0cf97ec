"""The OpenAI endpoints' work: a request body → validated requests → RequestFlow → choices.

Each prompt of a request is one pdserve request (own id, trace, workers), driven exactly as the
gRPC servicer drives it (router/request_run.py), with the body's n choices (OpenAI's choice
index: prompt * n + choice); the prompts run concurrently, and one failing cancels the others.
A request carries at most MAX_SEQUENCES sequences (prompts x n, the bound gRPC puts on n) and
request_text_bytes of text; its CPU work (decoding a large body, rendering a chat) runs on the
service's bounded pool, off the event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing

from router.bounded_pool import BoundedPool
from router.http.chat_template import ChatTemplate, ChatTemplateError
from router.http.choices import Choice
from router.http.errors import UnknownModel
from router.http.request_body import request_text_bytes
from router.http.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from router.http.tool_output import ToolOutput
from router.http.tool_parsers import parser_for_template
from router.http.tool_request import calls_wanted, forces_calls, template_tools
from router.http.translate import (
    chat_messages,
    check_supported,
    completion_prompts,
    generate_request,
    grammar_field,
    max_tokens_field,
    openai_names,
)
from router.observability import RequestObserver
from router.request_flow import RequestFlow
from router.request_run import Step, run_request
from router.tokenizing import BackgroundTokenizer
from router.types import Progress
from router.validation import ModelLimits, RequestError, ValidRequest, validate

# Variables a chat template gets from the server, which chat_template_kwargs cannot replace.
_TEMPLATE_INPUTS = frozenset({"messages", "add_generation_prompt", "tools", "documents"})
# Sequences (prompts x n) of one request: gRPC's bound on n, so neither API lets one request
# occupy more of the decode batch than the other.
MAX_SEQUENCES = 64
# Bodies decoding or chats rendering at once, and waiting: a few large bodies at a time.
_CPU_THREADS = 1
_CPU_WAITING = 8


class OpenAIService:
    def __init__(
        self,
        flow: RequestFlow,
        tokenizer: BackgroundTokenizer,
        limits: ModelLimits,
        observer: RequestObserver | None = None,
        chat_template: ChatTemplate | None = None,
        one_token_per_event: bool = False,
    ) -> None:
        self.flow = flow
        # Every stream sends each token as its own event (`--stream-one-token-per-event`).
        self.one_token_per_event = one_token_per_event
        self.tokenizer = tokenizer
        self.limits = limits
        self.observer = observer
        self.chat_template = chat_template
        self.cpu = BoundedPool("request body", _CPU_THREADS, _CPU_WAITING)

    async def prepare(self, body: SamplingFields) -> list[ValidRequest]:
        """The body's validated requests, one per prompt; raises RequestError naming the
        OpenAI field, or UnknownModel."""
        check_supported(body)
        if body.model is not None and body.model != self.limits.name:
            raise UnknownModel(
                f"model: the model {body.model!r} does not exist; "
                f"this server serves {self.limits.name!r}"
            )
        if isinstance(body, ChatCompletionRequest):
            _check_text_total("messages", _message_texts(body), self.limits)
            prompts, fields = [await self.cpu.run(self._render, body)], ["messages"]

            async def tokenize(text: str) -> list[int]:
                return await self.tokenizer.encode(text, add_special_tokens=False)
        else:
            assert isinstance(body, CompletionRequest)
            prompts = completion_prompts(body.prompt)
            fields = (
                ["prompt"] if len(prompts) == 1 else [f"prompt[{i}]" for i in range(len(prompts))]
            )
            _check_sequences(len(prompts), body.n)
            _check_text_total("prompt", [p for p in prompts if isinstance(p, str)], self.limits)
            tokenize = self.tokenizer.encode
        valid = []
        for prompt, field in zip(prompts, fields, strict=True):
            try:
                valid.append(await validate(generate_request(body, prompt), self.limits, tokenize))
            except RequestError as e:
                raise openai_names(e, field, max_tokens_field(body), grammar_field(body)) from None
        return valid

    def close(self) -> None:
        self.tokenizer.close()
        self.cpu.close()

    def _render(self, body: ChatCompletionRequest) -> str:
        if self.chat_template is None:
            raise RequestError(
                "messages: this model has no chat template (no chat_template in its "
                "tokenizer_config.json); send a prompt to /v1/completions instead"
            )
        variables = body.chat_template_kwargs or {}
        reserved = sorted(_TEMPLATE_INPUTS & variables.keys())
        if reserved:
            raise RequestError(f"chat_template_kwargs: {reserved[0]!r} is set by the server")
        tools = template_tools(body)
        if tools and "tools" not in self.chat_template.source:
            raise RequestError("tools: this model's chat template does not render tools")
        try:
            return self.chat_template.render(
                chat_messages(body), body.add_generation_prompt, tools, **variables
            )
        except ChatTemplateError as e:
            raise RequestError(f"messages: the model's chat template refused them: {e}") from None

    def tool_output(self, body: SamplingFields) -> ToolOutput | None:
        """How the output is read for tool calls; None when it is not (prepare has passed)."""
        if not isinstance(body, ChatCompletionRequest) or not calls_wanted(body):
            return None
        assert self.chat_template is not None
        return ToolOutput(parser_for_template(self.chat_template.source), forces_calls(body))

    def choices(self, valid: list[ValidRequest]) -> list[Choice]:
        """n choices per prompt, in OpenAI's order; a prompt's choices share its Progress."""
        received = time.perf_counter()
        choices = []
        for v in valid:
            progress = Progress(received=received, prompt_tokens=len(v.prompt_ids))
            for _ in range(v.sampling.n):
                choices.append(Choice(len(choices), v.prompt_ids, progress))
        return choices

    async def collect(
        self, valid: list[ValidRequest], choices: list[Choice], metadata: Mapping[str, str]
    ) -> None:
        """Runs every choice to its end."""

        async def one(request: ValidRequest, own: list[Choice]) -> None:
            async with aclosing(self._steps(request, own, metadata)) as steps:
                async for _ in steps:
                    pass

        try:
            async with asyncio.TaskGroup() as group:
                for request, own in _by_request(valid, choices):
                    group.create_task(one(request, own))
        except BaseExceptionGroup as failed:
            raise failed.exceptions[0] from None

    async def stream(
        self,
        valid: list[ValidRequest],
        choices: list[Choice],
        metadata: Mapping[str, str],
        one_token_per_event: bool = False,
    ) -> AsyncIterator[tuple[Choice, Step]]:
        """Every choice's steps as they come, one token each if `one_token_per_event` or the
        server says so; closing it aborts what still runs."""
        per_token = one_token_per_event or self.one_token_per_event
        if len(valid) == 1:
            async with aclosing(self._steps(valid[0], choices, metadata, per_token)) as steps:
                async for choice, step in steps:
                    yield choice, step
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(request: ValidRequest, own: list[Choice]) -> None:
            try:
                async with aclosing(self._steps(request, own, metadata, per_token)) as steps:
                    async for choice, step in steps:
                        queue.put_nowait((choice, step, None))
            except Exception as e:
                queue.put_nowait((own[0], None, e))

        tasks = [asyncio.create_task(pump(r, own)) for r, own in _by_request(valid, choices)]
        try:
            running = len(choices)
            while running:
                choice, step, error = await queue.get()
                if error is not None:
                    raise error
                yield choice, step
                running -= step.batch.finished
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _steps(
        self,
        request: ValidRequest,
        own: list[Choice],
        metadata: Mapping[str, str],
        one_token_per_batch: bool = False,
    ) -> AsyncIterator[tuple[Choice, Step]]:
        """The request's steps, each with the choice (of `own`, its n choices) it carries."""
        steps = run_request(
            self.flow,
            self.observer,
            request,
            metadata,
            own[0].progress,
            self.limits.name,
            one_token_per_batch,
        )
        async with aclosing(steps):
            async for step in steps:
                choice = own[step.batch.index]
                choice.add(step.batch)
                yield choice, step


def _check_sequences(prompts: int, n: int) -> None:
    if prompts > 1 and prompts * n > MAX_SEQUENCES:
        raise RequestError(
            f"n: {prompts} prompts x n={n} are {prompts * n} sequences; at most "
            f"{MAX_SEQUENCES} per request"
        )


def _message_texts(body: ChatCompletionRequest) -> list[str]:
    texts = []
    for message in body.messages:
        if isinstance(message.content, str):
            texts.append(message.content)
        elif message.content:
            texts.extend(part.text for part in message.content if part.text)
    return texts


def _check_text_total(field: str, texts: list[str], limits: ModelLimits) -> None:
    """A request's texts together within request_text_bytes (a character is at least a byte:
    most oversized requests are caught without encoding)."""
    limit = request_text_bytes(limits)
    size = sum(map(len, texts))
    if size <= limit:
        size = sum(len(t.encode("utf-8")) for t in texts)
    if size > limit:
        raise RequestError(
            f"{field}: {size} bytes of text together exceed the limit of {limit} bytes per "
            "request (send longer batches as several requests)"
        )


def _by_request(
    valid: list[ValidRequest], choices: list[Choice]
) -> list[tuple[ValidRequest, list[Choice]]]:
    """Each request with its n choices (OpenAI's order: prompt by prompt)."""
    out, start = [], 0
    for request in valid:
        out.append((request, choices[start : start + request.sampling.n]))
        start += request.sampling.n
    return out
