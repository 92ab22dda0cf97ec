"""The decode fast path (`--compile`): a decode-only step (every sequence computes one token
and samples, no DoLa/SLED exits, no drafts) runs as a compiled graph with static shapes.

The batch is padded up to a bucket size (1, 2, 4, 8, ... up to max_num_seqs, like vLLM's
CUDA-graph capture sizes) and the block tables to one of four widths per doubling of the
context (width_bucket), so a few graphs serve every step; the paged KV layout is the eager
model's. Padding rows repeat row 0 (its token, position, slot and block table): they compute
and store exactly row 0's K/V, so they never touch another block, and their logits are dropped.
A step's inputs travel as one flat int64 buffer. The graph is compiled with inductor's default
mode; on CUDA each shape's graph is then captured as a CUDA graph and replayed
(cuda_graphs.py). Attention is one opaque op in the graph (models/attention_op.py), so the
graph writes the KV cache in place; where the eager steps read decode rows' KV blocks in place
(models/attention.reads_in_place: the CPU kernel, Triton's on a GPU), so does the graph, which
then attends over each row's own context instead of gathering the whole padded table.
Mixed and prefill steps stay eager (ModelRunner.run).
"""

from __future__ import annotations

import torch

from pdserve.engine.decoding.factuality import plan_exits
from pdserve.engine.gpu_step.cuda_graphs import CudaGraphs
from pdserve.engine.gpu_step.host_tensors import append_padded, int64_tensor
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.models.attention import AttentionContext
from pdserve.models.llama import LlamaForCausalLM


def use_compile(setting: bool | None, device: str) -> bool:
    """`--compile` as given, else on for CUDA and off for CPU (where inductor does not pay
    for the tiny decode graphs: BENCHMARKS.md, "Compiled decode")."""
    return device.startswith("cuda") if setting is None else setting


def resolve_placeholders(ids: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """`ids` with each placeholder -(r + 1) replaced by tokens[r], where the tensors are (a step
    launched before the previous one's tokens reached the host: overlapped_steps.py)."""
    return torch.where(ids < 0, tokens[(-1 - ids).clamp(min=0)], ids)


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Padded batch sizes: powers of two below max_num_seqs, then max_num_seqs itself."""
    sizes = []
    size = 1
    while size < max_num_seqs:
        sizes.append(size)
        size *= 2
    return sizes + [max_num_seqs]


def bucket_for(n: int, buckets: list[int]) -> int:
    """The smallest bucket holding n (buckets ascending, n <= the last)."""
    return next(b for b in buckets if b >= n)


# Block tables are at least this many tokens wide: short contexts share one graph, and
# attending over a few padded keys costs less than compiling a graph per small width.
MIN_WIDTH_TOKENS = 128
# Widths per doubling of the context. The graph gathers every row's whole padded table each
# layer, so padding is paid in HBM traffic: with one width per doubling (powers of two), a
# 1040-token context padded to 2048 made the compiled 8B-shape step slower than the eager one
# at batch 32-64 on an H100 (BENCHMARKS.md, "Compiled decode at long contexts"); four per
# doubling pad by at most a quarter, for four times the graphs as contexts grow.
WIDTHS_PER_DOUBLING = 4


def width_bucket(num_blocks: int, block_size: int) -> int:
    """Block-table width in blocks: num_blocks rounded up to a quarter of the power of two
    below it (at most 25% padding), at least MIN_WIDTH_TOKENS wide (a graph per width
    bucket, not per context length)."""
    floor = -(-MIN_WIDTH_TOKENS // block_size)
    if num_blocks <= floor:
        return floor
    step = max((1 << ((num_blocks - 1).bit_length() - 1)) // WIDTHS_PER_DOUBLING, 1)
    return -(-num_blocks // step) * step


class CompiledDecode:
    """Runs decode-only batches through a compiled forward + LM head of `model`."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: torch.Tensor,
        block_size: int,
        max_num_seqs: int,
        device: torch.device,
        in_place: bool = False,
    ) -> None:
        """`in_place`: attention reads each row's blocks in place (ModelRunner.reads_kv_in_place)."""
        self.model = model
        self.in_place = in_place
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self.buckets = batch_buckets(max_num_seqs)
        self.steps = 0  # decode steps run compiled
        self.shapes: set[tuple[int, int]] = set()  # (batch, width) graphs compiled so far
        # Each (batch, width) pair is one static-shape graph; dynamo's default limit of
        # recompiles per function is lower than the number of pairs a server meets.
        width_kinds = WIDTHS_PER_DOUBLING * (max(kv_cache.shape[2], 1).bit_length() + 1)
        limit = len(self.buckets) * width_kinds
        dynamo = torch._dynamo.config
        dynamo.recompile_limit = max(dynamo.recompile_limit, limit)
        dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, 4 * limit)
        self._step = torch.compile(self._forward, dynamic=False)
        self._graphs = CudaGraphs(device, self.buckets[-1]) if device.type == "cuda" else None

    def handles(self, batch: ScheduledBatch) -> bool:
        """Whether `batch` is decode-only: one new token per sequence, each sampling, no
        drafts, no early exits, and no more sequences than the largest bucket."""
        if len(batch.seqs) > self.buckets[-1]:
            return False
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            if n != 1 or seq.num_computed_tokens + 1 != seq.num_tokens or seq.num_draft_tokens:
                return False
        config = self.model.config
        params = [seq.params for seq in batch.seqs]
        return plan_exits(params, config.num_layers, config.tie_word_embeddings) is None

    def run(
        self, batch: ScheduledBatch, placeholder_tokens: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits [B, vocab] (float32) of a batch `handles` accepted, in batch order.
        `placeholder_tokens`: what ids -(r + 1) stand for (ModelRunner.run)."""
        bs = self.block_size
        real = len(batch.seqs)
        padded = bucket_for(real, self.buckets)
        tables = [seq.block_table for seq in batch.seqs]
        positions = [seq.num_computed_tokens for seq in batch.seqs]
        width = width_bucket(max(p // bs + 1 for p in positions), bs)
        rows = list(range(real)) + [0] * (padded - real)
        # ids, positions, slots, then the block tables: one host-to-device copy
        flat = [batch.seqs[r].token_ids[-1] for r in rows]
        flat += [positions[r] for r in rows]
        flat += [tables[r][positions[r] // bs] * bs + positions[r] % bs for r in rows]
        inputs = int64_tensor(append_padded(flat, [tables[r] for r in rows], width))
        self.steps += 1
        self.shapes.add((padded, width))

        def forward(on_device: torch.Tensor) -> torch.Tensor:
            return self._step(on_device, self.kv_cache, width)

        def resolve(on_device: torch.Tensor) -> None:  # the ids lead the buffer
            ids = on_device[:padded]
            ids.copy_(resolve_placeholders(ids, placeholder_tokens))

        prepare = None if placeholder_tokens is None else resolve
        if self._graphs is None:
            if prepare is not None:
                prepare(inputs)
            return forward(inputs)[:real]
        logits = self._graphs.run((padded, width), inputs, forward, prepare)
        return logits[:real].clone()  # the results buffer is reused by the next run

    def _forward(
        self,
        inputs: torch.Tensor,  # [Bp * (3 + W)]: ids, positions, slots, then the block tables
        kv_cache: torch.Tensor,
        width: int,  # W
    ) -> torch.Tensor:  # [Bp, vocab]
        padded = inputs.shape[0] // (3 + width)
        input_ids, positions, slot_mapping, tables = inputs.split([padded] * 3 + [padded * width])
        block_tables = tables.view(padded, width)
        if self.in_place:  # each row over its own context: its position, plus itself
            mask, context_lens = None, positions + 1
        else:
            key_pos = torch.arange(block_tables.shape[1] * self.block_size, device=positions.device)
            mask = (key_pos[None, :] <= positions[:, None])[:, None, None, :]  # [Bp, 1, 1, S]
            context_lens = None
        ctx = AttentionContext(
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            attn_mask=mask,
            query_index=None,
            unpad_index=None,
            context_lens=context_lens,
        )
        hidden = self.model(input_ids, positions, kv_cache, ctx)
        return self.model.compute_logits(hidden)
