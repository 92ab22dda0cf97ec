"""OutputText: a request's text and stop strings, made by the router from every token it sends;
ChoiceOutputs: one OutputText per choice of a request with n > 1 (or beam search).

The router is the one place that sees all of a request's tokens, whichever attempts produced
them, so text is decoded here by one IncrementalDetokenizer over the whole output: a character
split across a retry boundary, or a stop string spanning it, comes out as in an uninterrupted
run. Workers still match stop strings themselves, which ends their work early, but their text
is not used.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pdserve.core.messages import TokenBatch
from pdserve.core.sampling_params import SamplingParams
from pdserve.tokenizer import IncrementalDetokenizer, Tokenizer


class OutputText:
    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int], sampling: SamplingParams
    ) -> None:
        self._detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_ids, sampling.stop, min_tokens=sampling.min_tokens
        )
        # Like the engine: a stop token ends the request and adds no text, once the output
        # has min_tokens tokens (before, the engine's sampler never chooses one).
        self._min_tokens = sampling.min_tokens
        self._stop_tokens = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            self._stop_tokens.update(tokenizer.eos_token_ids)

    def take(self, batch: TokenBatch) -> TokenBatch:
        """The batch with the router's text delta; cut after the token that completes a stop
        string, which finishes it with "stop"."""
        detokenizer, text = self._detokenizer, ""
        for i, token in enumerate(batch.token_ids):
            if token in self._stop_tokens and len(detokenizer.output_ids) >= self._min_tokens:
                break
            text += detokenizer.add([token])
            if detokenizer.stopped is not None:
                return dataclasses.replace(
                    batch,
                    token_ids=batch.token_ids[: i + 1],
                    logprobs=batch.logprobs[: i + 1],
                    text=text,
                    finished=True,
                    finish_reason="stop",
                )
        if batch.finished:
            text += detokenizer.flush()
        return dataclasses.replace(batch, text=text)


def per_token(batch: TokenBatch) -> list[TokenBatch]:
    """The batch as one batch per token, for clients that time each token by its own event: the
    first carries what describes the whole batch (prompt and cache counts, prefill times,
    speculation counts), the last what ends it (finish, beam score). Text is left to
    OutputText.take, which then decodes each token on its own."""
    if len(batch.token_ids) <= 1:
        return [batch]
    last = len(batch.token_ids) - 1
    ending = {"finished": False, "finish_reason": None, "score": None, "cumulative_logprob": None}
    opening = {
        "num_prompt_tokens": 0,
        "num_cached_tokens": 0,
        "queue_s": None,
        "prefill_s": None,
        "num_draft_tokens": 0,
        "num_accepted_tokens": 0,
    }
    return [
        dataclasses.replace(
            batch,
            token_ids=[token],
            logprobs=batch.logprobs[i : i + 1],
            text="",
            **({} if i == last else ending),
            **({} if i == 0 else opening),
        )
        for i, token in enumerate(batch.token_ids)
    ]


class ChoiceOutputs:
    """Every choice of a request (n samples or beams): its OutputText, the tokens sent to the
    client, its log-probability sum, and whether it finished."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int], sampling: SamplingParams
    ) -> None:
        self._texts = [OutputText(tokenizer, prompt_ids, sampling) for _ in range(sampling.n)]
        self.emitted: list[list[int]] = [[] for _ in range(sampling.n)]
        self.finished = [False] * sampling.n
        self._logprob_sums = [0.0] * sampling.n
        self._sum_logprobs = sampling.logprobs

    def take(self, batch: TokenBatch) -> TokenBatch:
        """OutputText.take for the batch's choice (`batch.index` is the request's); a choice's
        last batch carries its cumulative log-probability when logprobs are on."""
        i = batch.index
        if self.finished[i]:
            raise ValueError(f"choice {i} sent tokens after it finished")
        batch = self._texts[i].take(batch)
        self.emitted[i] += batch.token_ids
        self._logprob_sums[i] += sum(batch.logprobs)
        if batch.finished:
            self.finished[i] = True
            if batch.cumulative_logprob is None and self._sum_logprobs:
                batch = dataclasses.replace(batch, cumulative_logprob=self._logprob_sums[i])
        return batch

    @property
    def num_tokens(self) -> int:
        """Tokens sent over all choices (the usage's completion tokens)."""
        return sum(map(len, self.emitted))

    @property
    def all_finished(self) -> bool:
        return all(self.finished)
