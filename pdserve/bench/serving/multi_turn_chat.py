"""The multi-turn chat that `bench kv-tiers` and `bench peer-pull` serve, and what both
measure of one way: its arguments, its requests, the least a cache could compute for it, the
warm-up prompts, one run's figures and worker-stat deltas, the ratios over the way without, the
table and the report."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
from pathlib import Path

from pdserve.bench.common.local_system import add_model_arguments, eos_ids, wait_idle


def add_model_arguments_first(p: argparse.ArgumentParser) -> None:
    """The flags before a bench's own: the model, the seed, the block size."""
    add_model_arguments(p, preset="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=16)


def add_chat_arguments(p: argparse.ArgumentParser) -> None:
    """The flags after a bench's own: the chat's group, --json."""
    chat = p.add_argument_group("multi-turn chat")
    chat.add_argument("--conversations", type=int, default=16)
    chat.add_argument("--turns", type=int, default=4)
    chat.add_argument("--system-prompts", type=int, default=4)
    chat.add_argument("--system-prompt-len", type=int, default=256)
    chat.add_argument("--user-len", type=int, default=64)
    chat.add_argument("--output-len", type=int, default=16)
    p.add_argument("--json", help="write both results and the ratios to this file")


@dataclasses.dataclass
class ChatResult:
    """The figures of the chat served one way that every bench of it reports; a bench's own
    result adds its stats and TTFT percentiles after these."""

    completed: int
    failed: int
    prompt_tokens: int
    computed_tokens: int  # prompt tokens the workers ran through the model
    minimum_tokens: int  # the least one cache that never evicts could compute
    hit_tokens: int  # prompt tokens found in a prefix cache, any tier, pulled ones included

    @property
    def computed_vs_minimum(self) -> float:
        return self.computed_tokens / max(1, self.minimum_tokens)


def chat_requests(args: argparse.Namespace, model_config: dict) -> list:
    from pdserve.workloads.datasets import DatasetConfig, generate_requests

    dataset = DatasetConfig(
        name="multi-turn",
        mt_conversations=args.conversations,
        mt_turns=args.turns,
        mt_system_prompts=args.system_prompts,
        mt_system_prompt_len=args.system_prompt_len,
        mt_user_len=args.user_len,
        mt_output_len=args.output_len,
    )
    try:
        dataset.validate()
    except ValueError as error:
        raise SystemExit(str(error)) from error
    return generate_requests(
        dataset,
        args.conversations * args.turns,
        args.seed,
        model_config["vocab_size"],
        eos_ids(model_config),
    )


def minimum_prefill_tokens(prompts: list[list[int]], block_size: int) -> int:
    """The least a cache that never evicts computes for these prompts in this order: each full
    block the first time it is seen, each prompt's partial tail, and one token for a prompt whose
    last full block is already cached (its last token runs again to sample the first output).
    In order, unlike `bench router`'s bound: a turn's last block is not cached before the turn
    that extends it, so the earlier turn computes it, with no extra token."""
    from pdserve.core.block_hash import prompt_block_hashes

    seen: set[int] = set()
    total = 0
    for prompt in prompts:
        chain = prompt_block_hashes(prompt, block_size)
        tail = len(prompt) % block_size
        if not tail and chain and chain[-1] in seen:
            total += 1
        else:
            total += sum(h not in seen for h in chain) * block_size + tail
        seen.update(chain)
    return total


def warm_up_requests(model_config: dict, args: argparse.Namespace) -> list:
    """Four unshared prompts as long as a system prompt, so first-call costs stay out of the
    figures."""
    from pdserve.workloads.datasets import DatasetConfig, generate_requests

    warm = DatasetConfig(
        name="random", random_input_len=args.system_prompt_len, random_output_len=4
    )
    return generate_requests(
        warm, 4, args.seed + 1, model_config["vocab_size"], eos_ids(model_config)
    )


def serve_chat(app, requests: list, args: argparse.Namespace, stat_fields: tuple[str, ...]):
    """Serves the chat once: `ChatResult`'s figures (as keywords), the records' summary, and
    each of `stat_fields`' growth over the run in that order, `WorkerStats` summed over all
    workers."""
    from pdserve.bench.common.load_generator import run_load
    from pdserve.workloads.metrics import run_duration, summarize

    fields = ("prefill_tokens", "prefix_hit_tokens", *stat_fields)
    before = _worker_stat_sums(app, fields)
    records = asyncio.run(
        run_load(f"127.0.0.1:{app.port}", requests, max_concurrency=args.max_concurrency)
    )
    wait_idle(app)
    after = _worker_stat_sums(app, fields)
    computed, hits, *deltas = (b - a for a, b in zip(before, after, strict=True))
    summary = summarize(records, run_duration(records) or 1e-9)
    figures = {
        "completed": summary.completed,
        "failed": summary.failed,
        "prompt_tokens": sum(r.prompt_len for r in records),
        "computed_tokens": computed,
        "minimum_tokens": minimum_prefill_tokens([r.prompt for r in requests], args.block_size),
        "hit_tokens": hits,
    }
    return figures, summary, tuple(deltas)


def _worker_stat_sums(app, fields: tuple[str, ...]) -> tuple[int, ...]:
    import ray

    workers = app.app.pool.workers.values()
    stats = ray.get([w.actor.stats.remote() for w in workers])
    return tuple(sum(getattr(s, field) for s in stats) for field in fields)


def ratios_over(without, other, fields: tuple[str, ...]) -> dict[str, float | None]:
    """`other`'s figures over the way without's (None where the way without measured 0)."""
    return {
        name: getattr(other, name) / getattr(without, name) if getattr(without, name) else None
        for name in fields
    }


def report(console, table, results: dict, ratios_key: str, ratios: dict, json_path) -> int:
    """Prints the table, writes every way's figures and the ratios to --json when given, and
    returns the exit status: 1 where any request failed."""
    console.print(table)
    if json_path:
        document = {
            way: dataclasses.asdict(r) | {"computed_vs_minimum": r.computed_vs_minimum}
            for way, r in results.items()
        } | {ratios_key: ratios}
        Path(json_path).write_text(json.dumps(document, indent=2) + "\n")
    return 1 if any(r.failed for r in results.values()) else 0


def chat_table(
    title: str,
    way_column: str,
    own_columns: dict[str, str],
    ttft_columns: dict[str, str],
    results: dict,
    ratio_rows: dict[str, dict[str, float | None]],
):
    """A row a way: the label, `ChatResult`'s computed and hit tokens, the bench's own fields
    (`own_columns`: field -> heading), its TTFT percentiles (`ttft_columns`, likewise), the
    failures; then a row of computed-token and TTFT ratios for each label of `ratio_rows`."""
    from rich.table import Table

    table = Table(title=title)
    columns = (
        way_column,
        "prefill computed",
        "vs minimum",
        "hit tokens",
        *own_columns.values(),
        *ttft_columns.values(),
        "failed",
    )
    for column in columns:
        table.add_column(column, justify="left" if column == columns[0] else "right")
    for way, r in results.items():
        table.add_row(
            way,
            str(r.computed_tokens),
            f"{r.computed_vs_minimum:.2f}x",
            str(r.hit_tokens),
            *(str(getattr(r, field)) for field in own_columns),
            *(f"{getattr(r, field):.1f}" for field in ttft_columns),
            str(r.failed),
        )
    table.add_section()
    for label, ratios in ratio_rows.items():
        table.add_row(
            label,
            ratio_text(ratios["computed_tokens"]),
            *("",) * (2 + len(own_columns)),
            *(ratio_text(ratios[field]) for field in ttft_columns),
            "",
        )
    return table


def ratio_text(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}"
