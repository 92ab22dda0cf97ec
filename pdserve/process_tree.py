"""The processes this one started, and theirs: what `pdserve serve` kills when Ctrl-C stops a
start-up half way (Ray's GCS and raylet, its workers, the private redis-server)."""

from __future__ import annotations

import contextlib

import psutil

KILL_WAIT_S = 1.0


def kill_descendants(wait: bool = True) -> list[int]:
    """SIGKILLs every descendant process and, with `wait`, waits up to KILL_WAIT_S for them to
    go; returns the pids of those still there (none, normally; [] without `wait`)."""
    children = psutil.Process().children(recursive=True)
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    if not wait:
        return []
    _, alive = psutil.wait_procs(children, timeout=KILL_WAIT_S)
    return [p.pid for p in alive]
