"""Why the nixl transport READs instead of having the prefill worker WRITE: deregistering memory
does not fence a peer's WRITE over UCX TCP or shared memory.

A WRITE design would need the decode worker to make a late WRITE (from a frozen prefill
worker, after the deadline) fail: for example by registering the reserved blocks per transfer
and deregistering them when the transfer ends. Here the target process registers a buffer,
publishes it, then deregisters it and drops the initiator's agent; only then does the initiator
post its WRITE. It completes and every byte lands in the deregistered memory: UCX's tcp
transport writes wherever the message says (the rkey is not checked on the target), and CMA
(shared memory) copies into the target's address space with process_vm_writev, which no
registration governs. If a NIXL/UCX release ever rejects such a WRITE, this test fails, and a
WRITE path with a registration fence becomes worth measuring again (docs/kv_transfer.md).
"""

from __future__ import annotations

import multiprocessing as mp
import time

import numpy as np
import pytest
import torch

from kv_transfer.nixl_agent import drive, make_agent

pytest.importorskip("nixl_cu12")

SIZE = 1 << 20
FILL = 0xAB


def _deregistered_target(ucx_tls: str, conn) -> None:
    """Child process: registers a zeroed buffer, sends where it lies, deregisters it when told
    the initiator knows it (and forgets the initiator), then progresses until told to report
    how many of its bytes were written."""
    agent = make_agent("fence-target", ucx_tls)
    buffer = torch.zeros(SIZE, dtype=torch.uint8)
    registration = agent.register_memory(buffer)
    conn.send((agent.get_agent_metadata(), buffer.data_ptr()))
    initiator = conn.recv()
    agent.deregister_memory(registration)
    agent.remove_remote_agent(initiator)
    conn.send("deregistered")
    drive(agent, conn.poll, lambda: False)  # over TCP, what lands needs this side's progress
    conn.recv()
    conn.send(int((buffer == FILL).sum()))


@pytest.mark.parametrize("ucx_tls", ["tcp", "shm,tcp"])
def test_deregistration_does_not_stop_a_late_write(ucx_tls):
    ctx = mp.get_context("spawn")
    parent, child_end = ctx.Pipe()
    child = ctx.Process(target=_deregistered_target, args=(ucx_tls, child_end), daemon=True)
    child.start()
    try:
        assert parent.poll(120), "the target process did not start"
        metadata, address = parent.recv()
        agent = make_agent("fence-initiator", ucx_tls)
        source = torch.full((SIZE,), FILL, dtype=torch.uint8)
        agent.register_memory(source)
        peer = agent.add_remote_agent(metadata)
        parent.send(agent.name)
        assert parent.poll(60) and parent.recv() == "deregistered"
        local = agent.get_xfer_descs(np.array([[source.data_ptr(), SIZE, 0]], np.uint64), "DRAM")
        remote = agent.get_xfer_descs(np.array([[address, SIZE, 0]], np.uint64), "DRAM")
        handle = agent.initialize_xfer("WRITE", local, remote, peer)
        state = [agent.transfer(handle)]

        def done() -> bool:
            if state[0] == "PROC":
                state[0] = agent.check_xfer_state(handle)
            return state[0] != "PROC"

        give_up = time.monotonic() + 60
        drive(agent, done, lambda: time.monotonic() > give_up)
        parent.send("report")
        assert parent.poll(60)
        landed = parent.recv()
        agent.release_xfer_handle(handle)
        # The late WRITE is neither refused nor kept out: it is DONE and all of it landed.
        assert (state[0], landed) == ("DONE", SIZE)
    finally:
        child.kill()
        child.join(timeout=10)
