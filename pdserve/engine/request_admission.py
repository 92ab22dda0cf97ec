"""`RequestAdmission`: a request checked and turned into its first `Sequence` (called by
`LLMEngine.add_request` and `reserve`), and the detokenizer of each sequence (also called by
the engine's forks for every choice they add)."""

from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Sequence as Seq
from typing import Any

from pdserve.core.grammar_spec import GrammarError
from pdserve.core.prompt_tokens import known_block_hashes
from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.decoding.grammar import Grammars
from pdserve.engine.decoding.premature_layers import request_layers
from pdserve.engine.sequence import Sequence
from pdserve.engine_config import EngineConfig
from pdserve.tokenizer import IncrementalDetokenizer, Tokenizer


class RequestAdmission:
    def __init__(
        self,
        config: EngineConfig,
        executor: Any,
        tokenizer: Tokenizer,
        grammars: Grammars,
        arrivals: Iterator[int],
        max_model_len: int,
        emit_text: bool,
    ) -> None:
        self.config = config
        self.executor = executor
        self.tokenizer = tokenizer
        self.grammars = grammars
        self.arrivals = arrivals  # the engine's arrival counter, shared with its forks
        self.max_model_len = max_model_len
        self.emit_text = emit_text
        self.eos_token_ids = set(tokenizer.eos_token_ids)

    def new_sequence(
        self, request_id: str, prompt: Seq[int], params: SamplingParams, prefill_only: bool
    ) -> Sequence:
        """The request's first sequence; ValueError (or GrammarError) naming what is wrong."""
        known_hashes = known_block_hashes(prompt, self.config.block_size)  # kept by PromptTokens
        prompt = list(prompt)
        if not prompt:
            raise ValueError("the prompt must have at least one token")
        vocab = self.executor.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(prompt) > self.max_model_len:
            raise ValueError(
                f"prompt of {len(prompt)} tokens exceeds max_model_len {self.max_model_len}"
            )
        if params.beam_search and not getattr(self.executor, "offers_beam_candidates", False):
            raise ValueError("beam_width: beam search needs the torch executor (not sim)")
        tied = bool(self.executor.model_config.get("tie_word_embeddings", False))
        layers = request_layers(params, self.executor.num_layers, tied)  # names the field
        mask = self.min_tokens_mask(params)
        grammar = None
        if params.grammar is not None:
            if self.config.kind == "sim":
                raise GrammarError("grammar: structured output needs the torch executor (not sim)")
            # A continuation's prompt ends with the seed_offset tokens generated so far.
            generated = prompt[len(prompt) - params.seed_offset :]
            grammar = self.grammars.start(params.grammar, generated)
        return Sequence(
            request_id=request_id,
            token_ids=prompt,
            num_prompt_tokens=len(prompt),
            params=params,
            arrival=next(self.arrivals),
            prefill_only=prefill_only,
            prompt_block_hashes=known_hashes,
            detokenizer=self.detokenizer(prompt, params),
            grammar=grammar,
            overlaps=(
                params.greedy
                and grammar is None
                and not (prefill_only or params.logprobs or params.beam_search or mask)
                and params.n == 1
                and params.repetition_penalty == 1.0
                and layers is None
            ),
            min_tokens_mask=mask,
        )

    def min_tokens_mask(self, params: SamplingParams) -> tuple[int, ...]:
        """The tokens the sampler masks until the output has min_tokens (Sequence)."""
        if not params.min_tokens:
            return ()
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops |= self.eos_token_ids
        return tuple(sorted(stops))

    def detokenizer(
        self, prompt: list[int], params: SamplingParams
    ) -> IncrementalDetokenizer | None:
        """Text for the client (unless the router decodes it) or for stop strings, else None."""
        if self.emit_text or params.stop:
            return IncrementalDetokenizer(
                self.tokenizer, prompt, params.stop, min_tokens=params.min_tokens
            )
        return None
