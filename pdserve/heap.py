"""The startup heap of a long-lived serving process, frozen out of the collector's passes.

CPython's cyclic collector walks every tracked object in its oldest generation on each full
pass, and a serving process holds tens of thousands from startup alone (modules, Ray, gRPC,
the model and its clients) that never become garbage. Measured here (BENCHMARKS.md), a full
pass took 26 ms in a process with the router's modules, Ray and gRPC (93k objects) and 149 ms
in one with a worker's modules and the built-in model's engine (326k), and every thread of the
process waits for it: the router's event loop, a worker's engine thread. `gc.freeze()` moves the
objects alive now to a permanent generation that passes skip (vLLM's API server and engine
core do the same once started). Only for a process that keeps what it loaded until it exits:
an object frozen and later dropped in a reference cycle is never freed.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def freeze_startup_heap(owner: str) -> int:
    """Collects what startup left behind, then freezes every object alive. Returns how many
    are frozen (all frozen so far, in this process)."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("%s: %d startup objects frozen out of the collector's passes", owner, frozen)
    return frozen
