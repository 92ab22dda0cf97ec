"""OutputText: a request's text and stop strings, made by the router from every token it sends.

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
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, sampling.stop)
        # Like the engine: a stop token ends the request and adds no text.
        self._stop_tokens = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            self._stop_tokens.update(tokenizer.eos_token_ids)

    def take(self, batch: TokenBatch) -> TokenBatch:
        """The batch with the router's text delta; cut after the token that completes a stop
        string, which finishes it with "stop"."""
        detokenizer, text = self._detokenizer, ""
        for i, token in enumerate(batch.token_ids):
            if token in self._stop_tokens:
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
