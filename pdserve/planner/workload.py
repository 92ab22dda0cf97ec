"""What the planner serves: request lengths (and optionally arrival times), and the sample of
them that one simulated rate probe offers.

A workload is a preset — `chat` (ShareGPT-like chat turns), `rag` (long summarization/RAG
prompts, short answers) or `mixed` (30% rag among chat), all from the `chat-rag` generator of
pdserve/workloads/datasets.py — or a JSONL file, one request a line: `[prompt_len, output_len]`,
`[prompt_len, output_len, arrival_s]`, or an object with those keys (`arrival` optional; given
for every line or for none). Prompt contents are random token ids: the planner models no
prefix sharing between requests.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pdserve.core.prompt_tokens import PromptTokens
from pdserve.workloads.datasets import DatasetConfig, generate_requests

# preset -> fields of the chat-rag DatasetConfig
PRESETS: dict[str, dict] = {
    "chat": {"rag_fraction": 0.0},
    "rag": {"rag_fraction": 1.0},
    "mixed": {},
}
# Prompt token ids are drawn from [FIRST_TOKEN, LAST_TOKEN]: ids the built-in tokenizer does not
# reserve (BOS 0, EOS 1) and small enough that Python shares their int objects.
FIRST_TOKEN, LAST_TOKEN = 2, 256
SAMPLE_STREAM = 1  # probe_sample's random stream, apart from the workload generator's


class WorkloadError(ValueError):
    """A workload that cannot be read: the message names the file and line."""


@dataclass(frozen=True)
class PlanRequest:
    prompt_len: int
    output_len: int
    arrival: float | None = None  # seconds from the trace's start; None: Poisson arrivals
    tag: str = ""


@dataclass(frozen=True)
class ProbeRequest:
    """One request of a probe: its prompt, and its arrival in units of the mean gap (at rate r
    it arrives at `unit_arrival / r` seconds). A sample's prompts are PromptTokens: every probe
    offers the same ones, and their block hashes are computed once, not in every probe."""

    index: int
    prompt: list[int]
    output_len: int
    unit_arrival: float
    tag: str = ""


def load_workload(spec: str, num_requests: int = 10_000, seed: int = 0) -> list[PlanRequest]:
    """The preset `spec` names (`num_requests` of it), or the JSONL file at `spec`."""
    if spec in PRESETS:
        config = DatasetConfig(name="chat-rag", **PRESETS[spec])
        # Token ids are redrawn per probe; the generator's only need a tiny vocabulary.
        requests = generate_requests(config, num_requests, seed, vocab_size=LAST_TOKEN + 1)
        return [PlanRequest(r.prompt_len, r.output_len, None, r.tag) for r in requests]
    path = Path(spec)
    if not path.is_file():
        presets = ", ".join(PRESETS)
        raise WorkloadError(f"--workload {spec!r}: neither a preset ({presets}) nor a file")
    return read_jsonl(path)


def read_jsonl(path: Path) -> list[PlanRequest]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise WorkloadError(f"{path}: {e}") from None
    requests = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            requests.append(_parse_line(line, f"{path}:{number}"))
    if not requests:
        raise WorkloadError(f"{path}: no requests")
    timed = sum(r.arrival is not None for r in requests)
    if timed not in (0, len(requests)):
        raise WorkloadError(f"{path}: arrival given for {timed} of {len(requests)} requests")
    return requests


def _parse_line(line: str, where: str) -> PlanRequest:
    try:
        item = json.loads(line)
    except ValueError as e:
        raise WorkloadError(f"{where}: not JSON ({e})") from None
    if isinstance(item, dict):
        unknown = set(item) - {"prompt_len", "output_len", "arrival"}
        if unknown:
            raise WorkloadError(f"{where}: unknown key {sorted(unknown)[0]!r}")
        values = [item.get("prompt_len"), item.get("output_len"), item.get("arrival")]
    elif isinstance(item, list) and len(item) in (2, 3):
        values = [*item, None][:3]
    else:
        raise WorkloadError(f"{where}: expected [prompt_len, output_len[, arrival]] or an object")
    prompt_len, output_len, arrival = values
    for name, value in (("prompt_len", prompt_len), ("output_len", output_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise WorkloadError(f"{where}: {name} must be an integer >= 1, got {value!r}")
    if arrival is not None and (
        isinstance(arrival, bool) or not isinstance(arrival, int | float) or arrival < 0
    ):
        raise WorkloadError(f"{where}: arrival must be a number of seconds >= 0, got {arrival!r}")
    return PlanRequest(prompt_len, output_len, None if arrival is None else float(arrival))


def probe_sample(requests: list[PlanRequest], size: int, seed: int = 0) -> list[ProbeRequest]:
    """`size` requests of the workload with prompts and unit-rate arrivals, the same for the
    same arguments. A timed trace keeps its first `size` requests and their relative gaps
    (scaled to a mean gap of 1); otherwise a random subset arrives as a Poisson process."""
    # A stream of its own: a preset workload is generated from `default_rng(seed)`, whose first
    # permutation places its rag prompts; drawn from the same stream, the sample's permutation
    # picked exactly those positions (a `mixed` sample was all rag).
    rng = np.random.default_rng([seed, SAMPLE_STREAM])
    timed = requests[0].arrival is not None
    if timed:
        chosen = sorted(requests, key=lambda r: r.arrival)[:size]
        start, end = chosen[0].arrival, chosen[-1].arrival
        per_gap = (len(chosen) - 1) / (end - start) if end > start else 0.0
        arrivals = [(r.arrival - start) * per_gap for r in chosen]
    else:
        order = rng.permutation(len(requests))[:size]
        chosen = [requests[i] for i in sorted(order)]
        arrivals = np.cumsum(rng.exponential(1.0, size=len(chosen))).tolist()
    return [
        ProbeRequest(
            index=i,
            prompt=PromptTokens(
                rng.integers(FIRST_TOKEN, LAST_TOKEN + 1, size=r.prompt_len).tolist()
            ),
            output_len=r.output_len,
            unit_arrival=arrival,
            tag=r.tag,
        )
        for i, (r, arrival) in enumerate(zip(chosen, arrivals, strict=True))
    ]
