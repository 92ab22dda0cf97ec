"""What one attempt of a request works on, and how RequestFlow (router/request_flow.py) reads its
end: the work of an attempt (a continuation after the tokens the client has), the works that
replace a failed one, a grammar refused by the worker, the client's share of cached tokens."""

from __future__ import annotations

import dataclasses

from pdserve.core.grammar_spec import GrammarError
from pdserve.core.messages import WorkRequest
from pdserve.core.sampling_params import SamplingParams
from router.output_text import ChoiceOutputs
from router.types import NoWorkerAvailable, Progress
from router.validation import RequestError


class NoRoom(RuntimeError):
    """The decode worker refused the reservation: its KV pool is full, not broken."""


def continuation(
    work_id: str,
    prompt_ids: list[int],
    choices: ChoiceOutputs,
    unit: list[int],
    sampling: SamplingParams,
    trace_context: dict[str, str],
) -> WorkRequest:
    """The work of one attempt: every choice of `unit` from the start, or one choice after
    what the client already has of it: those tokens join the prompt, which keeps greedy output
    identical to an uninterrupted run, and the seeded stream (the choice's: seed + index)
    resumes at their count, which keeps sampled output identical too."""
    if len(unit) > 1:
        return WorkRequest(work_id, list(prompt_ids), sampling, trace_context)
    (i,) = unit
    emitted = choices.emitted[i]
    return WorkRequest(
        request_id=work_id,
        prompt_token_ids=prompt_ids + emitted,
        sampling=dataclasses.replace(
            sampling,
            n=1,
            seed=None if sampling.seed is None else sampling.seed + i,
            max_tokens=sampling.max_tokens - len(emitted),
            min_tokens=max(sampling.min_tokens - len(emitted), 0),
            seed_offset=sampling.seed_offset + len(emitted),
        ),
        trace_context=trace_context,
    )


def grammar_refusal(exc: BaseException) -> RequestError | None:
    """The client's error when a worker refused the request's grammar (it compiles there,
    where xgrammar and torch are): a GrammarError anywhere in the exception's chain (Ray
    raises the worker's exception as a subclass of it, with the original as `cause`)."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, GrammarError):
            original = getattr(seen, "cause", None)
            message = original if isinstance(original, GrammarError) else seen
            return RequestError(f"sampling.{message.args[0] if message.args else message}")
        seen = seen.__cause__ or seen.__context__
    return None


def remaining(unit: list[int], choices: ChoiceOutputs, sampling: SamplingParams) -> list[list[int]]:
    """The works that replace a failed one: itself while none of its choices sent anything,
    else each unfinished choice alone (beam search cannot resume: its beams are gone)."""
    if not any(choices.emitted[i] or choices.finished[i] for i in unit):
        return [unit]
    if sampling.beam_search:
        raise NoWorkerAvailable("beam search failed after some beams were sent")
    return [[i] for i in unit if not choices.finished[i]]


def of_client_prompt(cached_tokens: int, progress: Progress) -> int:
    """Cached tokens of the client's prompt: a retry's prompt also holds tokens already
    generated, which its worker may find cached too."""
    return min(cached_tokens, progress.prompt_tokens)
