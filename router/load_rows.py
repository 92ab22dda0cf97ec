"""LoadRows: one role's workers' WorkerLoads in pool order, with their numbers kept as arrays.

A routing decision reads every worker's load, and between two polls only the workers it routes
to change. So the router keeps each role's loads here, updating a worker's row when its load
changes (a poll's answer, a routed or computed prompt, a change of health), and a decision reads
the arrays as they are: at 256 workers, making the list and the option matrix's table from each
worker's WorkerLoad cost ~200 us of a ~1.6 ms decision (BENCHMARKS.md, control plane).

It is a list of WorkerLoad, so the policy's enumeration reads it as any other; the option
matrix (router/option_matrix.py) takes `numbers` instead of reading every row.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from router.estimates import WorkerLoad

NUMBERS = 12  # WorkerLoad.numbers


class LoadRows(list[WorkerLoad]):
    def __init__(self, worker_ids: Iterable[str]) -> None:
        super().__init__(WorkerLoad(w, healthy=False) for w in worker_ids)
        self.position = {load.worker_id: i for i, load in enumerate(self)}
        self.numbers = np.zeros((NUMBERS, len(self)), dtype=np.int64)  # [number, worker]
        self.unhealthy = len(self)  # rows whose load says unhealthy

    def of(self, worker_id: str) -> WorkerLoad:
        return self[self.position[worker_id]]

    def set(self, load: WorkerLoad) -> None:
        """`load` becomes its worker's row."""
        i = self.position[load.worker_id]
        self.unhealthy += self[i].healthy - load.healthy
        self[i] = load
        self.numbers[:, i] = load.numbers

    @property
    def all_healthy(self) -> bool:
        return self.unhealthy == 0
