"""The torch side of the engine: `TorchExecutor` (the engine's executor seam: model, KV cache
tensor, sampler) and its `ModelRunner`, which owns the paged KV cache, turns a scheduled batch
into tensors, runs the forward pass and returns the logits of the sequences that sample."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import torch

from pdserve.engine.decoding.factuality import contrast_layers, plan_exits
from pdserve.engine.decoding.grammar_masks import GrammarMasks, MaskRows
from pdserve.engine.decoding.sampler import (
    Sampler,
    apply_repetition_penalty,
    mask_stops_before_min_tokens,
)
from pdserve.engine.gpu_step import memory_profile
from pdserve.engine.gpu_step.attention_batch import attention_context
from pdserve.engine.gpu_step.compiled_decode import (
    CompiledDecode,
    resolve_placeholders,
    use_compile,
)
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.engine.speculation.verification import verify
from pdserve.engine_config import EngineConfig
from pdserve.models.attention import reads_in_place
from pdserve.models.linear import choose_kernels
from pdserve.models.llama import LlamaForCausalLM
from pdserve.models.loader import DTYPES, load_model
from pdserve.models.moe import routed_tokens_per_layer
from pdserve.models.tensor_parallel import TensorParallel


class Launched(NamedTuple):
    """A step launched without waiting for its tokens (TorchExecutor.launch)."""

    sample_idx: list[int]
    tokens: torch.Tensor  # [N] int64 on the model's device: what a later launch's placeholders read
    host_tokens: torch.Tensor  # [N] int64 on the host, complete once `ready` has happened
    ready: torch.cuda.Event | None  # recorded after the copy to the host (None on CPU)


class TorchExecutor:
    """Runs the model of `model_dir` (engine.Executor): forward pass, sampling, KV reads and
    writes on the cache tensor. `tp`: this process is rank tp.rank of config.tp ranks that run
    the model together, each on its shard and its heads' KV (models/tensor_parallel.py); every
    rank must be given the same batches in the same order."""

    offers_beam_candidates = True  # beam rows get their best candidates (batch.beam_candidates)
    overlaps_steps = True  # launch/collect (engine/gpu_step/overlapped_steps.py)

    def __init__(
        self, config: EngineConfig, model_dir: Path, tp: TensorParallel | None = None
    ) -> None:
        if (tp.size if tp else 1) != config.tp:
            raise ValueError(
                f"EngineConfig.tp is {config.tp} but the engine was given "
                f"{'no tensor-parallel group' if tp is None else f'a group of {tp.size} ranks'}"
            )
        shared_devices = tp is None or not tp.own_device  # the ranks pick among this node's
        if (
            shared_devices
            and config.device.startswith("cuda")
            and config.tp > torch.cuda.device_count()
        ):
            raise ValueError(
                f"tp {config.tp} needs {config.tp} CUDA devices, this node has "
                f"{torch.cuda.device_count()}"
            )
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.model, self.model_config = load_model(model_dir, config.dtype, config.device, tp)
        if torch.device(config.device).type == "cpu":
            # After the thread count is set: the fastest GEMM depends on it.
            choose_kernels(self.model, max(config.max_num_batched_tokens, config.max_num_seqs))
        self.vocab_size = self.model.config.vocab_size
        self.num_layers = self.model.config.num_layers

        def runner(num_blocks: int) -> ModelRunner:
            dtype, device = DTYPES[config.dtype], torch.device(config.device)
            return ModelRunner(self.model, num_blocks, config.block_size, dtype, device)

        self.runner = runner(memory_profile.kv_pool_blocks(self.model_config, config, runner))
        self.kv_cache = self.runner.kv_cache
        # Compiled graphs would have to capture the ranks' collectives: not done (yet) under TP.
        if config.tp == 1 and use_compile(config.compile, config.device):
            self.runner.compiled_decode = CompiledDecode(
                self.model,
                self.kv_cache,
                config.block_size,
                config.max_num_seqs,
                torch.device(config.device),
                in_place=self.runner.reads_kv_in_place,
            )
        self.sampler = Sampler()
        self.grammar_masks = GrammarMasks(self.vocab_size)

    @property
    def bytes_per_block(self) -> int:
        return self.kv_cache[:, :, 0].numel() * self.kv_cache.element_size()

    def execute(
        self, batch: ScheduledBatch, step_started: float
    ) -> tuple[list[int], list[int], list[float | None]]:
        masks = self.grammar_masks.start(*_mask_rows(batch))  # filled while the forward runs
        logits, sample_idx = self.runner.run(batch)
        beams = _beam_logprobs(logits, sample_idx, batch)  # the model's, before the masks
        self.grammar_masks.apply(masks, logits)  # forks sample from their parent's masked row
        logits, draft_logits = logits[: len(sample_idx)], logits[len(sample_idx) :]
        logits, sample_idx = _with_fork_rows(logits, sample_idx, batch)
        if not sample_idx:
            return [], [], []
        sampled = [batch.sampling_seq(i) for i in sample_idx]
        tokens, logprobs = self.sampler(
            logits,
            [s.params for s in sampled],
            [s.num_output_tokens for s in sampled],
            [s.token_ids for s in sampled],
            [s.min_tokens_mask for s in sampled],
        )
        if beams is not None:
            _offer_beam_candidates(*beams, logits, batch)
        if len(draft_logits):
            self._verify_drafts(logits, draft_logits, sample_idx, sampled, batch)
        return sample_idx, tokens, logprobs

    def launch(self, batch: ScheduledBatch, follows: Launched | None) -> Launched:
        """Starts `batch`, whose rows are all plain greedy decodes (Sequence.overlaps), without
        waiting for its tokens. A placeholder -(r + 1) among its input ids is row r's token of
        `follows`, the step launched before it, taken on the device."""
        logits, sample_idx = self.runner.run(batch, follows.tokens if follows else None)
        tokens = logits.argmax(dim=-1)  # what the sampler gives a greedy row
        if tokens.device.type != "cuda":  # the model ran on the host: its tokens are here
            return Launched(sample_idx, tokens, tokens, None)
        host_tokens = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host_tokens.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return Launched(sample_idx, tokens, host_tokens, ready)

    def collect(self, launched: Launched) -> tuple[list[int], list[int], list[float | None]]:
        """A launched step's (sample indices, tokens, logprobs), as `execute` returns them;
        waits for the device to finish it."""
        if launched.ready is not None:
            launched.ready.synchronize()
        tokens = launched.host_tokens.tolist()
        return launched.sample_idx, tokens, [None] * len(tokens)

    def _verify_drafts(
        self,
        logits: torch.Tensor,
        draft_logits: torch.Tensor,
        sample_idx: list[int],
        sampled: list,
        batch: ScheduledBatch,
    ) -> None:
        """Verifies the sampled sequences' drafts into batch.verified
        (speculation/verification.py), those with as many drafts together: each one's draft rows,
        then its last row."""
        groups: dict[int, list[tuple[int, torch.Tensor]]] = {}
        offset = 0
        for row, (i, seq) in enumerate(zip(sample_idx, sampled, strict=True)):
            d = seq.num_draft_tokens
            if d:
                rows = torch.cat([draft_logits[offset : offset + d], logits[row : row + 1]])
                groups.setdefault(d, []).append((i, rows))
                offset += d
        for d, members in groups.items():
            seqs = [batch.seqs[i] for i, _ in members]
            probs = [s.draft_probs for s in seqs]
            q = None
            if any(p is not None for p in probs):  # point masses where a draft has none
                vocab = logits.shape[-1]
                q = torch.stack(
                    [
                        p.float().cpu()
                        if p is not None
                        else torch.nn.functional.one_hot(
                            torch.tensor(s.token_ids[-d:]), vocab
                        ).float()
                        for p, s in zip(probs, seqs, strict=True)
                    ]
                )
            generators = [
                [
                    self.sampler.generator_for(s.params, s.num_output_tokens - d + n)
                    for n in range(d + 1)
                ]
                for s in seqs
            ]
            # Each position's stop tokens masked as the plain sampler masks them there.
            stacked = mask_stops_before_min_tokens(
                torch.cat([rows for _, rows in members]).float(),
                [s.params for s in seqs for _ in range(d + 1)],
                [s.num_output_tokens - d + n for s in seqs for n in range(d + 1)],
                [s.min_tokens_mask for s in seqs for _ in range(d + 1)],
            )
            results = verify(
                stacked.view(len(seqs), d + 1, -1).cpu(),
                torch.tensor([s.token_ids[-d:] for s in seqs]),
                q,
                [s.params for s in seqs],
                generators,
            )
            for (i, _), result in zip(members, results, strict=True):
                batch.verified[i] = result

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        copy_kv_blocks(self.kv_cache, copies)

    def write_kv(
        self, block_ids: list[int], layer_start: int, data: torch.Tensor, head_start: int = 0
    ) -> None:
        """data [l1 - l0, 2, n, block_size, h, head_dim] into kv_cache[l0:l1, :, block_ids]'s
        heads [head_start, head_start + h) (a tensor-parallel handoff's part: fewer heads)."""
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.kv_cache.device)
        layers = slice(layer_start, layer_start + data.shape[0])
        heads = slice(head_start, head_start + data.shape[4])
        data = data.to(device=self.kv_cache.device, dtype=self.kv_cache.dtype)
        self.kv_cache[layers, :, :, :, heads].index_copy_(2, index, data)

    def read_kv(self, block_ids: list[int], layer_start: int, layer_end: int) -> torch.Tensor:
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.kv_cache.device)
        return self.kv_cache[layer_start:layer_end].index_select(2, index)

    def stats(self) -> dict[str, Any]:
        compiled = self.runner.compiled_decode
        stats: dict[str, Any] = {}
        if compiled is not None:
            stats["compiled_decode_steps"] = compiled.steps
        if self.model.config.moe is not None:
            stats["expert_tokens"] = routed_tokens_per_layer(self.model)
        return stats


def copy_kv_blocks(kv_cache: torch.Tensor, copies: list[tuple[int, int]]) -> None:
    """Copies whole blocks (source, destination) in a paged KV cache tensor, every layer."""
    device = kv_cache.device
    sources = torch.tensor([c[0] for c in copies], dtype=torch.int64, device=device)
    destinations = torch.tensor([c[1] for c in copies], dtype=torch.int64, device=device)
    # The right side is gathered first: a source that is also a destination reads old KV.
    kv_cache[:, :, destinations] = kv_cache[:, :, sources]


def _beam_logprobs(
    logits: torch.Tensor, sample_idx: list[int], batch: ScheduledBatch
) -> tuple[list[int], list[int], torch.Tensor] | None:
    """The beam rows (indices into logits), their sample indices, and their log-softmax with the
    repetition penalty applied to it, as transformers' beam search scores candidates; None
    when no row is a beam. Taken before the grammar masks: a constrained beam's scores stay
    the model's log-probabilities (transformers applies logits processors after the
    log-softmax), its disallowed tokens are then dropped (`_offer_beam_candidates`)."""
    rows = [r for r, i in enumerate(sample_idx) if batch.seqs[i].beam_top_k]
    if not rows:
        return None
    indices = [sample_idx[r] for r in rows]
    beams = [batch.seqs[i] for i in indices]
    # On the logits' device: only each row's top k cross to the host.
    logprobs = torch.log_softmax(logits[rows].float(), dim=-1)
    logprobs = apply_repetition_penalty(
        logprobs, [s.params for s in beams], [s.token_ids for s in beams]
    )
    return rows, indices, logprobs


def _offer_beam_candidates(
    rows: list[int],
    indices: list[int],
    logprobs: torch.Tensor,
    masked_logits: torch.Tensor,
    batch: ScheduledBatch,
) -> None:
    """Each beam's best `beam_top_k` (token, log-probability) pairs into
    batch.beam_candidates, without the tokens its grammar masked (-inf in `masked_logits`):
    fewer pairs where the grammar allows fewer tokens."""
    beams = [batch.seqs[i] for i in indices]
    if any(s.grammar is not None for s in beams):
        logprobs = logprobs.masked_fill(masked_logits[rows] == float("-inf"), float("-inf"))
    k = min(max(s.beam_top_k for s in beams), logprobs.shape[-1])
    values, tokens = (t.cpu().tolist() for t in logprobs.topk(k, dim=-1))
    for i, seq, vs, ts in zip(indices, beams, values, tokens, strict=True):
        n = seq.beam_top_k
        offered = zip(ts[:n], vs[:n], strict=True)
        batch.beam_candidates[i] = [(t, v) for t, v in offered if v != float("-inf")]


def _mask_rows(batch: ScheduledBatch) -> tuple[list[MaskRows], int]:
    """The constrained sequences' rows of the logits `ModelRunner.run` will return, and how
    many rows it returns: known before the forward, so their masks fill while it runs."""
    if all(seq.grammar is None for seq in batch.seqs):
        return [], 0
    sampling = [
        seq
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True)
        if seq.num_computed_tokens + n == seq.num_tokens
    ]
    num_rows = len(sampling) + sum(seq.num_draft_tokens for seq in sampling)
    masked, draft_row = [], len(sampling)
    for row, seq in enumerate(sampling):
        d = seq.num_draft_tokens
        if seq.grammar is not None:
            rows = (*range(draft_row, draft_row + d), row)
            drafts = tuple(seq.token_ids[len(seq.token_ids) - d :]) if d else ()
            masked.append(MaskRows(seq.grammar.matcher, rows, drafts))
        draft_row += d
    return masked, num_rows


def _draft_rows(batch: ScheduledBatch, sample_idx: list[int], last_rows: list[int]) -> list[int]:
    """The packed rows whose logits judge the drafts of each sampled sequence (ModelRunner.run)."""
    rows = []
    for i, last in zip(sample_idx, last_rows, strict=True):
        d = batch.seqs[i].num_draft_tokens
        rows.extend(range(last - d, last))
    return rows


def _with_fork_rows(
    logits: torch.Tensor, sample_idx: list[int], batch: ScheduledBatch
) -> tuple[torch.Tensor, list[int]]:
    """Adds a row per fork that samples from its parent's logits (batch.fork_samples), with
    the sample index batch.sampling_seq knows it by."""
    if not batch.fork_samples:
        return logits, sample_idx
    row_of = {i: row for row, i in enumerate(sample_idx)}
    rows = [row_of[parent] for parent, _ in batch.fork_samples]
    extra = range(len(batch.seqs), len(batch.seqs) + len(rows))
    return torch.cat([logits, logits[rows]]), sample_idx + list(extra)


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        config = model.config
        self.model = model
        self.block_size = block_size
        self.device = device
        self.early_exit_steps = 0  # steps that kept early-layer states (DoLa/SLED requests)
        self.compiled_decode: CompiledDecode | None = None  # the --compile fast path
        # Decode rows attend through a kernel that reads the KV blocks in place (on CPU built
        # here, once per machine, so the first step does not wait for it; on a GPU Triton's).
        self.reads_kv_in_place = reads_in_place(device, config.head_dim, block_size)
        # [num_layers, 2 (K, V), num_blocks, block_size, kv_heads, head_dim]: a layer range of
        # a set of blocks is kv_cache[l0:l1, :, block_ids] (what KV transfer reads and writes).
        self.kv_cache = torch.zeros(
            config.num_layers,
            2,
            num_blocks,
            block_size,
            model.kv_heads,  # this rank's, under tensor parallelism
            config.head_dim,
            dtype=dtype,
            device=device,
        )

    @torch.inference_mode()
    def run(
        self, batch: ScheduledBatch, placeholder_tokens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[int]]:
        """Computes every scheduled chunk. Returns logits [N + D, vocab] (float32) and the
        indices in `batch.seqs` of the N sequences whose tokens are now all computed. The first
        N rows are theirs (the last position's): the model's, or what DoLa/SLED make of them
        for requests that ask (decoding/factuality.py). The D rows after them are the draft rows of
        the sampled sequences with speculative drafts, in sample order: for d drafts, the d
        positions before the last (the last real token and all drafts but the last).
        `placeholder_tokens`: on the device, the tokens that input ids -(r + 1) stand for (row
        r's; engine/gpu_step/overlapped_steps.py)."""
        if self.compiled_decode is not None and self.compiled_decode.handles(batch):
            logits = self.compiled_decode.run(batch, placeholder_tokens)
            return logits, list(range(len(batch.seqs)))
        input_ids, positions, ctx, last_rows, sample_idx = self._prepare(batch)
        if placeholder_tokens is not None:
            input_ids = resolve_placeholders(input_ids, placeholder_tokens)
        config = self.model.config
        plan = plan_exits(
            [batch.seqs[i].params for i in sample_idx],
            config.num_layers,
            config.tie_word_embeddings,
        )
        draft_rows = None  # the packed rows that judge the drafts, when there are any
        if any(batch.seqs[i].num_draft_tokens for i in sample_idx):
            rows = _draft_rows(batch, sample_idx, last_rows.tolist())
            draft_rows = torch.tensor(rows, dtype=torch.int64, device=last_rows.device)
        if plan is None:
            hidden = self.model(input_ids, positions, self.kv_cache, ctx)  # [T, hidden]
            if not sample_idx:
                return hidden.new_empty(0, config.vocab_size), sample_idx
            # One LM head pass over the last rows and the draft rows: its weight (a sixth of
            # the small model's) is read once per verify step, not twice.
            rows = last_rows if draft_rows is None else torch.cat([last_rows, draft_rows])
            return self.model.compute_logits(hidden[rows]), sample_idx
        self.early_exit_steps += 1
        exit_rows = last_rows[torch.tensor(plan.rows, device=last_rows.device)]
        hidden, early = self.model.forward_with_exits(
            input_ids, positions, self.kv_cache, ctx, exit_rows, plan.layers
        )
        logits = contrast_layers(self.model.compute_logits, hidden[last_rows], early, plan)
        if draft_rows is None:
            return logits, sample_idx
        return torch.cat([logits, self.model.compute_logits(hidden[draft_rows])]), sample_idx

    def _prepare(self, batch: ScheduledBatch):
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts: list[int] = []
        last_rows: list[int] = []
        sample_idx: list[int] = []
        tables: list[list[int]] = []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens, strict=True)):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            table = seq.block_table
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            starts.append(start)
            tables.append(table)
            if end == seq.num_tokens:
                last_rows.append(len(input_ids) - 1)
                sample_idx.append(i)
        dev = self.device
        ctx = attention_context(
            starts, batch.num_tokens, tables, slots, bs, dev, self.reads_kv_in_place
        )
        ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        pos = torch.tensor(positions, dtype=torch.int64, device=dev)
        rows = torch.tensor(last_rows, dtype=torch.int64, device=dev)
        return ids, pos, ctx, rows, sample_idx
