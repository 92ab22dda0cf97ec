"""StepOutputs: a step's sampled tokens become the sequences' tokens and the step's
`RequestOutput`s — the per-token path of every engine, and the price of each token the offline
planner simulates (it makes millions of them).

`LLMEngine` (engine.py) owns one and calls `postprocess` after each step it ran, and
`append_tokens` for the first token of a committed handoff; `OverlappedSteps`
(gpu_step/overlapped_steps.py) calls `postprocess` when a launched step lands. It counts the
prompt and decode tokens the steps computed.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.decoding.forked_choices import ForkedChoices
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.scheduler import ScheduledBatch, Scheduler
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.engine.speculation.speculative_step import Speculation


class StepOutputs:
    def __init__(
        self,
        scheduler: Scheduler,
        block_manager: BlockManager,
        forks: ForkedChoices,
        speculation: Speculation | None,
        finish: Callable[[Sequence, str], None],
        eos_token_ids: set[int],
        max_model_len: int,
    ) -> None:
        """`forks`: the engine's n choices and beams; `speculation`: its speculative decoding,
        None without; `finish(seq, reason)` frees a sequence (the engine's)."""
        self._scheduler = scheduler
        self._block_manager = block_manager
        self._forks = forks
        self._speculation = speculation
        self._finish = finish
        self._eos_token_ids = eos_token_ids
        self._max_model_len = max_model_len
        self.prefill_tokens_computed = 0  # prompt tokens the steps computed (not cache hits)
        self.decode_tokens = 0  # tokens the decode rows computed, drafts not counted

    def postprocess(
        self,
        batch: ScheduledBatch,
        sample_idx: list[int],
        tokens: list[int],
        logprobs: list[float | None],
    ) -> list[RequestOutput]:
        # Once per scheduled sequence per step (the offline planner simulates millions of
        # tokens): the counters are summed here and added once.
        decoded = prefilled = 0
        cache_full_blocks = self._block_manager.cache_full_blocks
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            drafts = seq.num_draft_tokens  # counted by the speculation, cached after rollback
            if n == 1 + drafts and seq.num_computed_tokens >= seq.num_prompt_tokens:
                decoded += n - drafts
            else:
                prefilled += n - drafts
            seq.num_computed_tokens += n
            if not drafts:
                cache_full_blocks(seq)
        self.decode_tokens += decoded
        self.prefill_tokens_computed += prefilled
        outputs, searched = [], []
        beams_of, verified_of = self._forks.beams.get, batch.verified.get  # looked up once a step
        sampling_seq, append_tokens = batch.sampling_seq, self.append_tokens
        for i, token, logprob in zip(sample_idx, tokens, logprobs, strict=True):
            seq = sampling_seq(i)
            beams = beams_of(seq.request_id)
            verified = verified_of(i)
            if verified is not None and self._speculation is not None:
                drafted = seq.num_draft_tokens
                self._speculation.roll_back(seq, verified)
                run_logprobs = verified.logprobs or [None] * len(verified.token_ids)
                out = append_tokens(seq, verified.token_ids, run_logprobs)
                out.num_draft_tokens, out.num_accepted_tokens = drafted, verified.num_accepted
                outputs.append(out)
            elif beams is None:
                outputs.append(append_tokens(seq, (token,), (logprob,)))
            else:  # a beam offers candidates; the search steps once every beam offered
                beams.offers[id(seq)] = batch.beam_candidates[i]
                searched.append(seq.request_id)
        for request_id in dict.fromkeys(searched):
            outputs += self._forks.beam_step(request_id)
        return outputs

    def append_tokens(
        self, seq: Sequence, tokens: Seq[int], logprobs: Seq[float | None]
    ) -> RequestOutput:
        """Appends the step's tokens (one, or a verified speculative run) up to the first that
        ends the sequence; one output for all of them."""
        params, detokenizer, token_ids = seq.params, seq.detokenizer, seq.token_ids
        text, reason, emitted = "", None, 0
        # The length limit in tokens of token_ids (prompt + max_tokens, or the context).
        # (A comparison, not min(), and no zip over one token: ~0.3 us per token, measured.)
        limit = seq.num_prompt_tokens + params.max_tokens
        if limit > self._max_model_len:
            limit = self._max_model_len
        assert len(logprobs) == len(tokens)
        for token in tokens:
            token_ids.append(token)
            if params.logprobs:
                logprob = logprobs[emitted]
                seq.output_logprobs.append(logprob if logprob is not None else 0.0)
            emitted += 1
            stop_token = (
                token in params.stop_token_ids
                or (not params.ignore_eos and token in self._eos_token_ids)
            ) and len(token_ids) - seq.num_prompt_tokens > params.min_tokens  # min_tokens before it
            # Structured output ends where its grammar does (grammar.py).
            grammar_ended = seq.grammar is not None and seq.grammar.accept(token)
            if not stop_token and detokenizer is not None:
                text += detokenizer.add([token])
            stop_string = detokenizer is not None and detokenizer.stopped is not None
            reason = "stop" if stop_token or stop_string or grammar_ended else None
            if reason is None and len(token_ids) >= limit:
                reason = "length"
            if reason is not None:
                break
        if reason is not None and detokenizer is not None:
            text += detokenizer.flush()
        elif seq.prefill_only:
            reason = "prefill"
        if seq.prefill_only and (params.n > 1 or params.beam_search):
            reason = "prefill"  # the decode side judges choice 0's first token and forks
        # Fields by position, in RequestOutput's order: ten keywords made the call ~0.59 us,
        # positions ~0.29 us, once per request per step (test_step_outputs checks each field).
        out = RequestOutput(
            seq.request_id,
            seq.token_ids[-emitted:],  # new_token_ids
            seq.output_logprobs[-emitted:] if params.logprobs else None,  # new_logprobs
            text,  # text_delta
            reason is not None,  # finished
            reason,  # finish_reason
            seq.num_prompt_tokens,
            seq.num_cached_tokens,
            None,  # block_ids (a held prefill's, below)
            seq.index,
            self._forks.open_choices.get(seq.request_id, 0),  # open_choices
        )
        if reason == "prefill":
            self._scheduler.remove(seq)
            seq.status = SequenceStatus.HELD
            out.block_ids = list(seq.block_table)
        elif reason is not None:
            self._finish(seq, reason)
            out.open_choices = self._forks.close_choice(seq.request_id)
        return out
