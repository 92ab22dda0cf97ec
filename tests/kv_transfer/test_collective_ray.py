"""The collective transport between two Ray actors: the rendezvous address travels through Ray.

The decode actor's KV endpoint is returned through a Ray call and handed to the prefill actor,
which forms the pair's Gloo group from it. Starting Ray costs ~5-10 s, hence one test.
"""

from __future__ import annotations

import os

import pytest

ray = pytest.importorskip("ray")

SECRET = "ray-test-secret"


def _config():
    from pdserve.config import KVTransferConfig

    return KVTransferConfig(
        transport="collective", secret=SECRET, bind_host="127.0.0.1", chunk_bytes=1536
    )


@ray.remote(num_cpus=0)
class DecodeSide:
    def __init__(self) -> None:
        from kv_transfer import KVLayout, make_receiver
        from tests.kv_transfer.kv_helpers import TensorSink, make_cache

        self.sink = TensorSink(make_cache(None))
        self.receiver = make_receiver(_config(), self.sink, KVLayout.of(self.sink.cache))
        self.pid = os.getpid()

    def start(self) -> str:
        return self.receiver.start()

    def open(self, dest: list[int]) -> str:
        return self.receiver.open(dest, deadline_s=20)

    def received(self, dest: list[int]):
        return self.pid, self.sink.cache[:, :, dest].clone(), dict(self.sink.commits)


@ray.remote(num_cpus=0)
class PrefillSide:
    def __init__(self) -> None:
        from kv_transfer import make_sender

        self.sender = make_sender(_config())

    def send(self, endpoint: str, transfer_id: str, src: list[int]):
        from kv_transfer import CommitInfo, TransferRequest
        from tests.kv_transfer.kv_helpers import NUM_LAYERS, make_cache, reader

        request = TransferRequest(
            endpoint, transfer_id, src, NUM_LAYERS, reader(make_cache(1)), CommitInfo(7)
        )
        return os.getpid(), self.sender.send(request).bytes


def test_pair_group_forms_through_ray_and_moves_blocks_between_actors(ray_cluster):
    import torch

    from tests.kv_transfer.kv_helpers import make_cache

    decode, prefill = DecodeSide.remote(), PrefillSide.remote()
    try:
        endpoint = ray.get(decode.start.remote())
        src, dest = [0, 4, 8, 15], [2, 3, 11, 12]
        for _ in range(2):  # second transfer: same pair group
            transfer_id = ray.get(decode.open.remote(dest))
            sender_pid, nbytes = ray.get(
                prefill.send.remote(endpoint, transfer_id, src), timeout=60
            )
        receiver_pid, received, commits = ray.get(decode.received.remote(dest))
    finally:
        for actor in (decode, prefill):
            ray.kill(actor)
    assert sender_pid != receiver_pid != os.getpid()  # a real cross-process transfer
    assert torch.equal(received, make_cache(1)[:, :, src])
    assert nbytes == received.nbytes and [c.first_token_id for c in commits.values()] == [7, 7]
