"""The bare-NIXL ceiling of `bench transfer`: one region of the transfer's size moved between the
bench's two processes by NIXL alone (no pdserve protocol, checksum or block descriptors).

Each process has a second agent of its own (the transport's agents are left alone) with one
registered buffer. The bench process times a READ of the receiver's buffer into its own and a
WRITE of its own into the receiver's, each until its transfer state is DONE, while the receiver
drives its agent's progress (no progress threads, as in the transport). READ is the direction
pdserve's transport uses; WRITE shows what UCX does when the initiator pushes. The agents come
from `make_agent`, so the transport's UCX settings (`nixl_agent.UCX_TUNING`) apply here too.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

OPERATIONS = ("READ", "WRITE")


class Peer:
    """Receiver process side, made on the bench process's "ceiling" (then its agent metadata):
    answers with this side's metadata and buffer address; `progress` then drives this agent
    while one operation runs (from the receiver's "progress" command until "done")."""

    def __init__(self, conn: Any, ucx_tls: str | None, buffer: Any) -> None:
        from kv_transfer.nixl_agent import make_agent

        self.conn = conn
        self.agent = make_agent("ceiling-decode", ucx_tls)
        self.registration = self.agent.register_memory(buffer)
        self.agent.add_remote_agent(conn.recv())
        conn.send((self.agent.get_agent_metadata(), buffer.data_ptr()))

    def progress(self) -> None:
        from kv_transfer.nixl_agent import drive

        drive(self.agent, self.conn.poll, lambda: False)
        self.conn.recv()  # "done"

    def close(self) -> None:
        self.agent.deregister_memory(self.registration)


class Ceiling:
    """Bench process side: times bare READs and WRITEs of `source`'s size against the receiver."""

    def __init__(self, conn: Any, ucx_tls: str | None, source: Any) -> None:
        from kv_transfer.nixl_agent import make_agent

        self.conn, self.source = conn, source
        self.agent = make_agent("ceiling-prefill", ucx_tls)
        self.registration = self.agent.register_memory(source)
        conn.send("ceiling")
        conn.send(self.agent.get_agent_metadata())

    def connect(self, reply: tuple[bytes, int]) -> None:
        metadata, address = reply
        self.peer = self.agent.add_remote_agent(metadata)
        nbytes = self.source.nbytes
        self.local = self.agent.get_xfer_descs(
            np.array([[self.source.data_ptr(), nbytes, 0]], dtype=np.uint64), "DRAM"
        )
        self.remote = self.agent.get_xfer_descs(
            np.array([[address, nbytes, 0]], dtype=np.uint64), "DRAM"
        )

    def seconds(self, operation: str) -> float:
        """One bare `operation` of the whole region, timed from posting to DONE."""
        from kv_transfer.nixl_agent import drive

        agent = self.agent
        self.conn.send("progress")  # the receiver drives its agent until "done"
        start = time.perf_counter()
        handle = agent.initialize_xfer(operation, self.local, self.remote, self.peer)
        state = [agent.transfer(handle)]

        def done() -> bool:
            if state[0] == "PROC":
                state[0] = agent.check_xfer_state(handle)
            return state[0] != "PROC"

        drive(agent, done, lambda: False)
        elapsed = time.perf_counter() - start
        self.conn.send("done")
        agent.release_xfer_handle(handle)
        if state[0] != "DONE":
            raise RuntimeError(f"bare NIXL {operation} failed: {state[0]}")
        return elapsed

    def close(self) -> None:
        self.agent.deregister_memory(self.registration)
