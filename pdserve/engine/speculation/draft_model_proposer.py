"""DraftProposer: speculative decoding's draft-model proposer (the contract is in proposer.py).

A second, smaller model (`SpeculativeConfig.draft_model`, same vocabulary) loaded with pdserve's
loader on the target's device and dtype, with its own paged KV cache: shaped like the target's
pool (same number of blocks, same block size) but with the draft's layers, and indexed by the
target's block ids. Prefix sharing, forks and copy-on-write therefore carry over one to one
(`copy_blocks` mirrors the target's copies).

Which draft KV a block holds is recorded per block, not per sequence: (the chained hash of every
token before the block, the tokens whose KV fills its first slots). A sequence's draft KV is
valid up to the first block whose record disagrees with its tokens, so a prefix-cache hit
reuses the draft KV another request computed, a rejected draft token is recomputed next time
(its slot's record names the rejected token), and a block rewritten by another sequence is
recomputed by the one that lost it. Every write of this proposer updates the records, and only
this proposer writes its cache, so a record never lies.

`propose` computes each sequence's missing positions in one batched chunked forward (the whole
prompt the first time: on the decode worker of a disaggregated pair the draft's prompt KV is
computed here, at the first step after commit), then draws k tokens in k - 1 more single-token
forwards batched over all sequences: the argmax for greedy requests, a draw from the request's
filtered distribution q (returned by `draft_probs`) for sampled ones: a seeded request's
token at output index n is the Gumbel-max race of q with the noise the target draws that
position with (the coupled draw of verification.py: where both races have the same winner, the
draft is the target's own token). A constrained request's view carries a fork of its grammar:
the draft's logits are masked as the target's are (grammar_masks.py, filled while the draft's
forward runs), so it proposes only tokens the grammar allows, and stops after one that ends it. Forwards go through the engine's own `ModelRunner`. Two sequences of one call never touch a block the other writes (a
fork whose partly filled last block is still shared waits a step, until copy-on-write splits
it), so one forward never writes a slot twice.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pdserve.config import ConfigError
from pdserve.core.block_hash import ROOT_HASH, block_hash
from pdserve.engine.decoding.grammar_masks import GrammarMasks, MaskRows
from pdserve.engine.decoding.sampler import (
    DrawSource,
    draw,
    filtered_probs,
    mask_stops_before_min_tokens,
    noise_key,
)
from pdserve.engine.model_runner import ModelRunner, copy_kv_blocks
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.engine_config import EngineConfig
from pdserve.models.builtin import default_model_dir
from pdserve.models.hf_config import read_config
from pdserve.models.loader import DTYPES, load_model


class DraftProposer:
    """Proposes the draft model's continuation of each sequence (Proposer protocol)."""

    writes_kv = True

    def __init__(self, config: EngineConfig, num_blocks: int) -> None:
        draft_dir = Path(config.speculative.draft_model or "")
        draft_config = read_config(draft_dir)
        target_config = read_config(config.model or default_model_dir())
        if draft_config["vocab_size"] != target_config["vocab_size"]:
            raise ConfigError(
                "SpeculativeConfig",
                "draft_model",
                f"{draft_dir} has a vocabulary of {draft_config['vocab_size']} tokens, the "
                f"target {target_config['vocab_size']}: the draft needs the target's tokenizer",
            )
        self.model, _ = load_model(draft_dir, config.dtype, config.device)
        self.block_size = config.block_size
        self.max_positions = self.model.config.max_position_embeddings
        self._masks = GrammarMasks(draft_config["vocab_size"])
        self.runner = ModelRunner(
            self.model,
            num_blocks,
            config.block_size,
            DTYPES[config.dtype],
            torch.device(config.device),
        )
        self.kv_cache = self.runner.kv_cache
        # block id -> (hash of all tokens before the block, tokens whose draft KV it holds)
        self._records: dict[int, tuple[int, tuple[int, ...]]] = {}
        # id(seq) -> (seq, chained hashes of the full blocks of its accepted tokens)
        self._hashes: dict[int, tuple[Sequence, list[int]]] = {}
        self._generator = torch.Generator()  # draws of unseeded sampled requests
        self._generator.seed()
        self._probs: list[torch.Tensor | None] = []

    # ---- the Proposer protocol ----------------------------------------------------------
    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], k: int) -> list[list[int]]:
        self._drop_finished()
        proposals: list[list[int]] = [[] for _ in seqs]
        self._probs = [None] * len(seqs)
        drafts = self._plan(seqs, k)
        if not drafts:
            return proposals
        views = [view for _, view, _ in drafts]
        batch = ScheduledBatch()
        for view in views:
            batch.add(view, view.num_tokens - view.num_computed_tokens)
        probs: dict[int, list[torch.Tensor]] = {}  # index in drafts -> q of each token
        active = list(range(len(drafts)))
        while True:
            masks = self._masks.start(_mask_rows([views[i] for i in active]), len(active))
            logits, _ = self.runner.run(batch)
            self._masks.apply(masks, logits)
            self._record_writes(batch)
            tokens, qs = self._draw(logits, [views[i] for i in active])
            ended = set()  # views whose grammar the token just drawn ends
            for i, token, q in zip(active, tokens, qs, strict=True):
                proposals[drafts[i][0]].append(token)
                if q is not None:
                    probs.setdefault(i, []).append(q)
                grammar = views[i].grammar
                if grammar is not None and grammar.accept(token):
                    ended.add(i)
            active = [
                i for i in active if i not in ended and len(proposals[drafts[i][0]]) < drafts[i][2]
            ]
            if not active:
                break
            batch = ScheduledBatch()
            for i in active:  # the token just drawn is the next forward's input
                view = views[i]
                view.num_computed_tokens = view.num_tokens
                view.token_ids.append(proposals[drafts[i][0]][-1])
                batch.add(view, 1)
        for i, rows in probs.items():
            self._probs[drafts[i][0]] = torch.stack(rows)
        return proposals

    def draft_probs(self) -> list[torch.Tensor | None]:
        return self._probs

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        copy_kv_blocks(self.kv_cache, copies)
        moved = [(dst, self._records.get(src)) for src, dst in copies]
        for dst, record in moved:
            if record is None:
                self._records.pop(dst, None)
            else:
                self._records[dst] = record

    def forget(self, seq: Sequence) -> None:
        self._hashes.pop(id(seq), None)

    # ---- planning -----------------------------------------------------------------------
    def _plan(self, seqs: list[Sequence], k: int) -> list[tuple[int, Sequence, int]]:
        """(index in seqs, the draft's view of the sequence, tokens to draft) for each sequence
        that gets proposals. A view is a copy of the sequence whose computed tokens are those
        with valid draft KV (never the last: its logits give the first draft token)."""
        bs = self.block_size
        written: set[int] = set()
        read: set[int] = set()
        plans = []
        for index, seq in enumerate(seqs):
            n = seq.num_tokens
            count = min(k, len(seq.block_table) * bs - n + 1, self.max_positions - n + 1)
            if count < 1:
                continue
            start = min(self.valid_tokens(seq), n - 1)
            last = n + count - 2  # the last position a forward writes (a draft's input)
            reads = set(seq.block_table[: last // bs + 1])
            writes = set(seq.block_table[start // bs : last // bs + 1])
            if writes & read or reads & written:
                continue  # shares a block another sequence of this call writes
            written |= writes
            read |= reads
            view = Sequence(
                request_id=seq.request_id,
                token_ids=list(seq.token_ids),
                num_prompt_tokens=seq.num_prompt_tokens,
                params=seq.params,
                arrival=seq.arrival,
                block_table=seq.block_table,
                num_computed_tokens=start,
                index=seq.index,
                min_tokens_mask=seq.min_tokens_mask,
                grammar=seq.grammar.fork() if seq.grammar is not None else None,
            )
            view.block_hashes = list(self._accepted_hashes(seq))
            plans.append((index, view, count))
        return plans

    def _accepted_hashes(self, seq: Sequence) -> list[int]:
        """Chained hashes of the full blocks of seq's tokens (all accepted: computed once)."""
        entry = self._hashes.get(id(seq))
        if entry is None:
            entry = self._hashes[id(seq)] = (seq, [])
        hashes = entry[1]
        _extend_hashes(hashes, seq.token_ids, self.block_size)
        return hashes

    def valid_tokens(self, seq: Sequence) -> int:
        """How many leading tokens of seq have their draft KV in seq's blocks."""
        bs, tokens = self.block_size, seq.token_ids
        hashes = self._accepted_hashes(seq)
        valid = 0
        for j, block in enumerate(seq.block_table):
            record = self._records.get(block)
            if record is None or j * bs >= len(tokens):
                break
            parent = hashes[j - 1] if j else ROOT_HASH
            if record[0] != parent:
                break
            want = tokens[j * bs : (j + 1) * bs]
            same = _common_prefix(record[1], want)
            valid += same
            if same < bs:
                break
        return valid

    # ---- forwards -----------------------------------------------------------------------
    def _record_writes(self, batch: ScheduledBatch) -> None:
        """Records what the forward just wrote: each touched block now holds the view's
        tokens up to the last written slot (anything after it in the block is stale)."""
        bs = self.block_size
        for view, n in zip(batch.seqs, batch.num_tokens, strict=True):
            start, end = view.num_computed_tokens, view.num_computed_tokens + n
            _extend_hashes(view.block_hashes, view.token_ids[:end], bs)
            for j in range(start // bs, (end - 1) // bs + 1):
                parent = view.block_hashes[j - 1] if j else ROOT_HASH
                tokens = tuple(view.token_ids[j * bs : min(end, (j + 1) * bs)])
                self._records[view.block_table[j]] = (parent, tokens)

    def _draw(
        self, logits: torch.Tensor, views: list[Sequence]
    ) -> tuple[list[int], list[torch.Tensor | None]]:
        """One draft token per view, and the distribution q it was drawn from: the argmax
        (q None) for greedy requests, the sampler's draw from the request's filtered
        distribution for sampled ones (seeded: with the target's noise of that position)."""
        # The target's own mask of stop tokens before min_tokens (the drafts then need not
        # guess a token the target cannot emit).
        logits = mask_stops_before_min_tokens(
            logits,
            [view.params for view in views],
            [view.num_output_tokens for view in views],
            [view.min_tokens_mask for view in views],
        )
        tokens = logits.argmax(dim=-1).tolist()
        qs: list[torch.Tensor | None] = [None] * len(views)
        sampled = [r for r, view in enumerate(views) if not view.params.greedy]
        if sampled:
            # On the CPU, like the target's sampler and verification: unseeded rows' generator is
            # a CPU generator.
            rows = logits[sampled].float().cpu()
            params = [views[r].params for r in sampled]
            q = filtered_probs(rows, params)
            sources = [self._source_for(views[r]) for r in sampled]
            picked = draw(rows, params, sources).tolist()
            for row, r in enumerate(sampled):
                tokens[r] = picked[row]
                qs[r] = q[row]
        return tokens, qs

    def _source_for(self, view: Sequence) -> DrawSource:
        """A seeded request's draw of its n-th token uses the target's noise key of that token
        (the coupled draw); unseeded ones share the proposer's generator."""
        if view.params.seed is None:
            return self._generator
        return noise_key(view.params, view.num_output_tokens)

    def _drop_finished(self) -> None:
        """Forgets sequences that finished without `forget` (their id may be reused)."""
        done = [
            key for key, (seq, _) in self._hashes.items() if seq.status == SequenceStatus.FINISHED
        ]
        for key in done:
            del self._hashes[key]


def _extend_hashes(hashes: list[int], tokens: list[int], block_size: int) -> None:
    """Appends the chained hashes of the full blocks of `tokens` that `hashes` lacks."""
    for j in range(len(hashes), len(tokens) // block_size):
        parent = hashes[j - 1] if j else ROOT_HASH
        hashes.append(block_hash(parent, tokens[j * block_size : (j + 1) * block_size]))


def _common_prefix(a: tuple[int, ...], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _mask_rows(views: list[Sequence]) -> list[MaskRows]:
    """The constrained views' rows of the draft's logits (one per view, in order)."""
    return [MaskRows(v.grammar.matcher, (r,)) for r, v in enumerate(views) if v.grammar]
