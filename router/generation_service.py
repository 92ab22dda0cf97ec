"""The pdserve.v1.Generation servicer: protobuf in, RequestFlow, protobuf out. Kept thin."""

from __future__ import annotations

import logging
import time
from contextlib import aclosing

from pdserve.pb import generate_pb2, generate_pb2_grpc
from router.errors import status_for
from router.request_flow import RequestFlow
from router.request_run import run_request
from router.tokenizing import BackgroundTokenizer
from router.types import Progress
from router.validation import ModelLimits, check_model, check_text_size, validate

log = logging.getLogger(__name__)

_FINISH = {
    "stop": generate_pb2.FINISH_REASON_STOP,
    "length": generate_pb2.FINISH_REASON_LENGTH,
    "abort": generate_pb2.FINISH_REASON_ABORT,
}


class GenerationService(generate_pb2_grpc.GenerationServicer):
    """API keys and undecodable requests are handled before these methods, by the server's
    interceptors (router/auth.py, router/request_decoding.py)."""

    def __init__(
        self,
        flow: RequestFlow,
        tokenizer: BackgroundTokenizer,
        limits: ModelLimits,
        info: dict,
        observer=None,
    ) -> None:
        self._flow = flow
        self._tokenizer = tokenizer
        self._limits = limits
        self._info = info  # ModelInfo fields that do not change (transport, block size)
        self._observer = observer  # RequestObserver: metrics and spans; None = off
        self.worker_counts = lambda: (0, 0)
        self._token_strings: list[str] | None = None  # each token id's string, for Tokenize

    def close(self) -> None:
        self._tokenizer.close()

    async def Generate(self, request, context):  # noqa: N802 (gRPC method name)
        received = time.perf_counter()
        try:
            valid = await validate(request, self._limits, self._tokenizer.encode)
        except Exception as exc:
            await context.abort(*status_for(exc))
        request_id, prompt_ids, sampling = valid.request_id, valid.prompt_ids, valid.sampling
        metadata = dict(context.invocation_metadata() or ())
        progress = Progress(received=received, prompt_tokens=len(prompt_ids))
        log.debug("request %s runs on the workers as %s", request_id, valid.work_id)
        error = None
        try:
            steps = run_request(
                self._flow, self._observer, valid, metadata, progress, self._limits.name
            )
            async with aclosing(steps):
                async for step in steps:
                    batch = step.batch
                    response = generate_pb2.GenerateResponse(
                        request_id=request_id,
                        token_ids=batch.token_ids,
                        text=batch.text,
                        logprobs=batch.logprobs if sampling.logprobs else [],
                        index=batch.index,
                    )
                    if batch.finished:
                        response.finish_reason = _FINISH.get(
                            batch.finish_reason, generate_pb2.FINISH_REASON_STOP
                        )
                        if batch.cumulative_logprob is not None:
                            response.cumulative_logprob = batch.cumulative_logprob
                        if batch.score is not None:
                            response.score = batch.score
                    if step.last:
                        response.usage.CopyFrom(
                            generate_pb2.Usage(
                                prompt_tokens=len(prompt_ids),
                                completion_tokens=progress.completion_tokens,
                                cached_prompt_tokens=progress.cached_tokens,
                            )
                        )
                    if step.first or step.last:
                        response.timings.CopyFrom(_timings(progress, step.at, step.last))
                    yield response
        except Exception as exc:
            error = exc
        if error is not None:
            log.warning("request %s failed: %s", request_id, error)
            await context.abort(*status_for(error))

    async def Tokenize(self, request, context):  # noqa: N802
        try:
            check_model("model", request.model, self._limits)
            check_text_size("text", request.text, self._limits.max_prompt_bytes)
        except Exception as exc:
            await context.abort(*status_for(exc))
        ids = await self._tokenizer.encode(request.text, request.add_special_tokens)
        return await self._tokenizer.run(self._tokenize_response, ids)

    def _tokenize_response(self, ids: list[int]) -> bytes:
        """The serialized TokenizeResponse (sent as it is: router/request_decoding.py), made
        on a tokenizer thread: a million token strings take a second to make, 0.1 s to
        serialize."""
        if self._token_strings is None:  # once: a lookup per token is 10x a call into Rust
            tokenizer = self._tokenizer.tokenizer
            strings = [tokenizer.id_to_token(i) or "" for i in range(tokenizer.vocab_size)]
            self._token_strings = strings
        tokens = [self._token_strings[i] for i in ids]
        return generate_pb2.TokenizeResponse(token_ids=ids, tokens=tokens).SerializeToString()

    async def GetModelInfo(self, request, context):  # noqa: N802
        prefill, decode = self.worker_counts()
        return generate_pb2.ModelInfo(
            name=self._limits.name,
            vocab_size=self._limits.vocab_size,
            max_model_len=self._limits.max_model_len,
            eos_token_ids=self._limits.eos_token_ids,
            prefill_workers=prefill,
            decode_workers=decode,
            **self._info,
        )


def _timings(progress: Progress, now: float, last: bool) -> generate_pb2.Timings:
    ms = 1000.0
    timings = generate_pb2.Timings(
        queue_ms=progress.queue_s * ms,
        prefill_ms=progress.prefill_s * ms,
        transfer_ms=progress.transfer_s * ms,
        ttft_ms=(progress.first_token_at - progress.received) * ms,
        prefill_worker=progress.prefill_worker,
        decode_worker=progress.decode_worker,
        disaggregated=progress.disaggregated,
    )
    if last:
        timings.e2e_ms = (now - progress.received) * ms
    return timings
