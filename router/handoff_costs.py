"""HandoffCost: the fixed time a remote prefill spends on its handoff, learned as observed.

A remote prefill's first token waits, beyond the prefill worker's queue and compute, for the
handoff's round trips: the reservation on the decode worker (which answers after its step in
progress), the call to the prefill worker (likewise), and the first token's way back. A local
prefill pays none of them. Unpriced, they made `--disaggregate auto` send short prompts to an
idle prefill worker although a local prefill was cheaper (docs/benchmarks/simulation.md, issue
14). The router measures each remote prefill's routed -> first answer span minus the prefill
worker's queue and compute times (Routing.on_prefill_done); this keeps their mean, forgetting
old samples as the cost model's lines do. Pure Python, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class HandoffCost:
    """Seconds of one remote prefill's handoff: an exponentially-forgetting mean of the samples,
    pulled towards `prior_s` by `prior_weight` pseudo-samples that fade like real ones."""

    prior_s: float = 0.002  # a few gRPC hops on a LAN, before any measurement
    prior_weight: float = 2.0
    decay: float = 0.97  # as LinearFit's: a sample's weight halves after ~23 newer ones
    samples: int = 0
    _weight: float = 0.0
    _sum: float = 0.0

    def __post_init__(self) -> None:
        self._weight, self._sum = self.prior_weight, self.prior_weight * self.prior_s

    def observe(self, seconds: float) -> None:
        if seconds < 0:
            return  # a clock step, not a measurement
        self._weight = self.decay * self._weight + 1.0
        self._sum = self.decay * self._sum + seconds
        self.samples += 1

    @property
    def seconds(self) -> float:
        return self._sum / self._weight

    def scaled(self, factor: float) -> HandoffCost:
        """The same prior in another clock (CostModel.with_priors_scaled)."""
        return HandoffCost(self.prior_s * factor, self.prior_weight, self.decay)
