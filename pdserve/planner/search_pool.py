"""The processes `Search(jobs=...)` searches a wave's splits in (`pdserve plan --jobs`).

Started by a fork server (spawn where there is none), not forked from the searching process:
that process may run threads (OpenTelemetry's span exporter, gRPC's), and a child forked from
them can abort in their at-fork handlers (seen in CI: BrokenProcessPool). Each worker is given
the search once, pickled, by the pool's initializer.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from typing import Any, Protocol


class SplitSearcher(Protocol):
    """What a worker needs of the search (planner/search.py's Search), named here rather than
    imported: search.py imports this module, and the planner has no import cycles."""

    def _search(self, result: Any, bar: float, best: float, start: float) -> None: ...


_WORKER_SEARCH: SplitSearcher | None = None  # in a worker process: the search it was given


@contextmanager
def worker_pool(search: SplitSearcher, jobs: int) -> Iterator[ProcessPoolExecutor | None]:
    """`jobs` worker processes, each given `search` (None when `jobs` <= 1: search here)."""
    if jobs <= 1:
        yield None
        return
    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    context = multiprocessing.get_context(method)
    with ProcessPoolExecutor(
        jobs, mp_context=context, initializer=_adopt_search, initargs=(search,)
    ) as pool:
        yield pool


def _adopt_search(search: SplitSearcher) -> None:
    global _WORKER_SEARCH
    _WORKER_SEARCH = search


def search_in_worker(result: Any, bar: float, best: float, start: float) -> Any:
    """Searches one split in a worker of `worker_pool` (Search._search) and returns it."""
    assert _WORKER_SEARCH is not None, "only a worker started by worker_pool"
    _WORKER_SEARCH._search(result, bar, best, start)
    return result
