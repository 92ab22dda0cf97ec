"""`--sim-profile` values: which timing model a sim worker uses.

- `analytical:GPU` or `analytical:GPU:tpN` — the roofline over a GPU of `gpus.GPUS` with the
  default efficiencies, tensor parallel over N GPUs.
- a path to a JSON file: `{"kind": "analytical", "gpu": "h100", "tp": 2, "efficiency":
  {"compute": 0.5, ...}, "expert_imbalance": 1.2}` (the last: a mixture of experts' max / mean
  load per GPU, at least 1; default timing.DEFAULT_EXPERT_IMBALANCE) or `{"kind": "linear", "step_s": ..., "prefill_token_s": ...,
  "decode_seq_s": ..., "context_token_s": ...}` (coefficients fitted on a real engine; other
  keys such as "device" are kept as notes), optionally with `"spread": {"decode": [[ratio,
  gap_s, fitted_s], ...], "prefill": [...], "seed": 0}` (a `StepSpread`: how the served steps
  scattered around the fit, each with the seconds the fit gives it, which older files lack:
  [ratio, gap_s]; absent, every step lasts the fitted mean).

Every mistake is a one-line `ProfileError` naming what is known.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.sim.gpus import GPUS, gpu_spec
from pdserve.sim.model_shape import ModelShape
from pdserve.sim.timing import (
    DEFAULT_EXPERT_IMBALANCE,
    AnalyticalTiming,
    Efficiency,
    LinearTiming,
    StepSpread,
    StepTiming,
)

ANALYTICAL = re.compile(r"analytical:(?P<gpu>[\w-]+)(?::tp(?P<tp>\d+))?")
KINDS = ("analytical", "linear")
LINEAR_KEYS = tuple(f.name for f in dataclasses.fields(LinearTiming) if f.name != "spread")
# Keys a linear profile may leave out (0): files fitted before the coefficient existed.
OPTIONAL_LINEAR_KEYS = ("prefill_step_s",)
SPREAD_TABLES = ("decode", "prefill")
EFFICIENCY_KEYS = tuple(f.name for f in dataclasses.fields(Efficiency))


class ProfileError(ValueError):
    """An unknown or malformed simulation profile."""


@dataclass(frozen=True)
class AnalyticalProfile:
    gpu: str
    tp: int = 1
    efficiency: Efficiency = Efficiency()
    expert_imbalance: float = DEFAULT_EXPERT_IMBALANCE


Profile = AnalyticalProfile | LinearTiming


def parse_profile(spec: str) -> Profile:
    """The profile `spec` names; ProfileError when it is unknown or malformed."""
    if spec.startswith("analytical:"):
        match = ANALYTICAL.fullmatch(spec)
        if match is None:
            raise ProfileError(f"{spec!r}: expected analytical:GPU or analytical:GPU:tpN")
        return _analytical(match["gpu"], int(match["tp"] or 1), {}, spec)
    path = Path(spec)
    if path.suffix != ".json" or not path.is_file():
        raise ProfileError(
            f"{spec!r} is neither analytical:GPU[:tpN] (GPUs: {', '.join(sorted(GPUS))}) "
            "nor an existing .json profile file"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ProfileError(f"{spec}: not readable JSON ({e})") from None
    if not isinstance(data, dict) or data.get("kind") not in KINDS:
        raise ProfileError(f'{spec}: needs an object with "kind": one of {", ".join(KINDS)}')
    if data["kind"] == "linear":
        required = tuple(key for key in LINEAR_KEYS if key not in OPTIONAL_LINEAR_KEYS)
        coefficients = _numbers(data, required, spec, required=True)
        coefficients |= _numbers(data, OPTIONAL_LINEAR_KEYS, spec, required=False)
        return LinearTiming(**coefficients, spread=_spread(data.get("spread"), spec))
    efficiency = data.get("efficiency", {})
    if not isinstance(efficiency, dict):
        raise ProfileError(f'{spec}: "efficiency" must be an object')
    tp = data.get("tp", 1)
    if not isinstance(tp, int) or isinstance(tp, bool):
        raise ProfileError(f'{spec}: "tp" must be an integer, got {tp!r}')
    profile = _analytical(str(data.get("gpu")), tp, efficiency, spec)
    imbalance = data.get("expert_imbalance", DEFAULT_EXPERT_IMBALANCE)
    if isinstance(imbalance, bool) or not isinstance(imbalance, int | float) or imbalance < 1:
        raise ProfileError(f'{spec}: "expert_imbalance" must be a number >= 1, got {imbalance!r}')
    return dataclasses.replace(profile, expert_imbalance=float(imbalance))


def timing_model(profile: Profile, model_config: dict[str, Any], dtype: str) -> StepTiming:
    """The step-time model of `profile` for the model of `model_config` (config.json)."""
    if isinstance(profile, LinearTiming):
        return profile
    shape = ModelShape.from_config(model_config, dtype)
    return AnalyticalTiming(
        shape, gpu_spec(profile.gpu), profile.tp, profile.efficiency, profile.expert_imbalance
    )


def _analytical(gpu: str, tp: int, efficiency: dict, spec: str) -> AnalyticalProfile:
    if gpu.lower() not in GPUS:
        raise ProfileError(f"{spec}: unknown GPU {gpu!r} (known: {', '.join(sorted(GPUS))})")
    if tp < 1:
        raise ProfileError(f"{spec}: tensor parallel degree must be at least 1, got {tp}")
    unknown = [key for key in efficiency if key not in EFFICIENCY_KEYS]
    if unknown:
        known = ", ".join(EFFICIENCY_KEYS)
        raise ProfileError(f"{spec}: unknown efficiency {unknown[0]!r} (known: {known})")
    factors = _numbers(efficiency, EFFICIENCY_KEYS, spec, required=False)
    for name, value in factors.items():
        if name != "step_overhead_s" and not 0 < value <= 1:
            raise ProfileError(f"{spec}: efficiency {name} must be in (0, 1], got {value}")
    return AnalyticalProfile(gpu.lower(), tp, Efficiency(**factors))


def _spread(data: Any, spec: str) -> StepSpread | None:
    """The "spread" of a linear profile (None when absent): tables of [ratio, gap_s, fitted_s]
    triples (or [ratio, gap_s] pairs, without a size) of non-negative numbers."""
    if data is None:
        return None
    if not isinstance(data, dict):
        raise ProfileError(f'{spec}: "spread" must be an object')
    unknown = [key for key in data if key not in (*SPREAD_TABLES, "seed")]
    if unknown:
        known = ", ".join((*SPREAD_TABLES, "seed"))
        raise ProfileError(f'{spec}: unknown "spread" key {unknown[0]!r} (known: {known})')
    seed = data.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ProfileError(f'{spec}: "spread" seed must be an integer, got {seed!r}')
    tables = {}
    for name in SPREAD_TABLES:
        entries = data.get(name, [])
        if not isinstance(entries, list) or not all(_spread_entry(entry) for entry in entries):
            raise ProfileError(
                f'{spec}: "spread" {name!r} must be a list of [ratio, gap_s] pairs or '
                "[ratio, gap_s, fitted_s] triples of non-negative numbers"
            )
        tables[name] = tuple(tuple(float(value) for value in entry) for entry in entries)
    return StepSpread(**tables, seed=seed)


def _spread_entry(entry: Any) -> bool:
    return isinstance(entry, list) and len(entry) in (2, 3) and all(map(_non_negative, entry))


def _non_negative(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and value >= 0


def _numbers(data: dict, keys: tuple[str, ...], spec: str, *, required: bool) -> dict[str, float]:
    """The non-negative numbers `data` holds under `keys` (all of them when required)."""
    values: dict[str, float] = {}
    for key in keys:
        if key not in data:
            if required:
                raise ProfileError(f"{spec}: missing {key!r} (needs {', '.join(keys)})")
            continue
        value = data[key]
        if not _non_negative(value):
            raise ProfileError(f"{spec}: {key!r} must be a non-negative number, got {value!r}")
        values[key] = float(value)
    return values
