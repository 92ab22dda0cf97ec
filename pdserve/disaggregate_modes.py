"""`--disaggregate`: how the router decides between a remote and a local prefill.

    auto                  by cost, per request (router/policy.py: the cost policy's objective)
    always                remote (local only when no prefill worker is healthy)
    never                 local: colocated serving
    threshold:N           llm-d's rule: remote when more than N prompt tokens are uncached
                          (its shipped N is 16), else local
    conditional:LEN:QUEUE Dynamo's disaggregated router: remote when more than LEN prompt tokens
                          are uncached and the prefill queue holds fewer than QUEUE requests

The two rules are the field's, kept as baselines that `auto` is measured against (`pdserve
bench sim-disagg --suite`); the policy still picks the workers within the kind they choose.
Parsed here, apart from the router, so that the configuration can check the flag.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

FIXED = ("auto", "always", "never")
FORMS = "auto, always, never, threshold:N or conditional:LEN:QUEUE"


@dataclass(frozen=True)
class DisaggregateMode:
    kind: str  # one of FIXED, "threshold" or "conditional"
    min_uncached_tokens: int = 0  # the rules: remote only above this many uncached tokens
    max_prefill_queue: int = 0  # conditional: remote only while fewer requests are queued

    @property
    def is_rule(self) -> bool:
        return self.kind in ("threshold", "conditional")


@functools.cache
def parse_disaggregate(spec: str) -> DisaggregateMode:
    """The mode `spec` names; ValueError naming the accepted forms."""
    name, *numbers = spec.strip().split(":")
    if name in FIXED and not numbers:
        return DisaggregateMode(name)
    wanted = {"threshold": 1, "conditional": 2}.get(name)
    if wanted is None or len(numbers) != wanted:
        raise ValueError(f"must be one of {FORMS}, got {spec!r}")
    try:
        values = [int(n) for n in numbers]
    except ValueError:
        raise ValueError(f"{name}: token and queue bounds are integers, got {spec!r}") from None
    if min(values) < 0 or (name == "conditional" and values[1] < 1):
        raise ValueError(f"{name}: bounds must be >= 0 (a queue bound >= 1), got {spec!r}")
    return DisaggregateMode(name, *values)
