"""Where the KV endpoint and the collective rendezvous listen: only where peers dial them."""

from __future__ import annotations

import dataclasses

import grpc
import psutil
import pytest

from kv_transfer import CommitInfo, KVLayout, TransferRequest, make_receiver
from kv_transfer.collective_sender import CollectiveKVSender
from kv_transfer.grpc_sender import ControlStub
from pdserve.pb import kv_transfer_pb2 as pb
from tests.kv_transfer.conftest import SECRET
from tests.kv_transfer.kv_helpers import NUM_LAYERS, make_cache, reader

OTHER_LOOPBACK = "127.0.0.2"  # also this machine, but not the advertised address
METADATA = (("x-pdserve-kv-secret", SECRET),)


def reachable(host: str, port: int) -> bool:
    stub = ControlStub.dial(f"{host}:{port}")
    try:
        stub.abort(pb.AbortRequest(transfer_id="probe"), timeout=3, metadata=METADATA)
        return True
    except grpc.RpcError as exc:
        assert exc.code() is grpc.StatusCode.UNAVAILABLE, exc
        return False
    finally:
        stub.channel.close()


@pytest.mark.parametrize(("bind_host", "everywhere"), [(None, False), ("0.0.0.0", True)])
def test_kv_endpoint_listens_on_its_advertised_address_unless_told(
    config, sink, bind_host, everywhere
):
    config = dataclasses.replace(config, bind_host=bind_host, advertise_host="127.0.0.1")
    receiver = make_receiver(config, sink, KVLayout.of(sink.cache))
    endpoint = receiver.start()
    try:
        port = int(endpoint.rsplit(":", 1)[1])
        assert endpoint == f"127.0.0.1:{port}" and reachable("127.0.0.1", port)
        assert reachable(OTHER_LOOPBACK, port) is everywhere
    finally:
        receiver.stop()


def _listening() -> set[tuple[str, int]]:
    return {
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process().net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    }


def test_collective_transport_opens_no_port_on_every_interface(config, sink):
    before = _listening()
    config = dataclasses.replace(config, transport="collective", reservation_timeout_s=10.0)
    receiver = make_receiver(config, sink, KVLayout.of(sink.cache))
    receiver.start()
    sender = CollectiveKVSender(config)
    try:
        tid = receiver.open([3, 7, 9], deadline_s=10)
        src = reader(make_cache(1))
        sender.send(
            TransferRequest(receiver.endpoint, tid, [1, 2, 5], NUM_LAYERS, src, CommitInfo(1))
        )
        opened = _listening() - before
        assert opened and all(ip.removeprefix("::ffff:") == "127.0.0.1" for ip, _ in opened), opened
    finally:
        sender.close()
        receiver.stop()


def test_rendezvous_needs_the_secret_and_an_issued_pair_id(config, sink):
    config = dataclasses.replace(config, transport="collective")
    receiver = make_receiver(config, sink, KVLayout.of(sink.cache))
    receiver.start()
    stub = ControlStub.dial(receiver.endpoint)
    try:
        pair_id = stub.connect(pb.ConnectRequest(backend="gloo"), metadata=METADATA).pair_id
        check = pb.RendezvousRequest(pair_id=pair_id, op=pb.RendezvousRequest.CHECK, keys=["k"])
        with pytest.raises(grpc.RpcError) as info:
            stub.rendezvous(check, timeout=5)  # no secret
        assert info.value.code() is grpc.StatusCode.UNAUTHENTICATED
        guessed = pb.RendezvousRequest(pair_id="guessed", op=pb.RendezvousRequest.SET, key="k")
        with pytest.raises(grpc.RpcError) as info:
            stub.rendezvous(guessed, timeout=5, metadata=METADATA)
        assert info.value.code() is grpc.StatusCode.NOT_FOUND
        assert stub.rendezvous(check, timeout=5, metadata=METADATA).present is False
    finally:
        stub.channel.close()
        receiver.stop()


def test_nixl_agents_listen_only_on_the_bind_host(config, sink):
    pytest.importorskip("nixl_cu12")
    from kv_transfer.nixl_sender import NixlKVSender

    before = _listening()
    config = dataclasses.replace(
        config, transport="nixl", nixl_ucx_tls="tcp", reservation_timeout_s=10.0
    )
    receiver = make_receiver(config, sink, KVLayout.of(sink.cache), kv_cache=sink.cache)
    receiver.start()
    src_cache = make_cache(1)
    sender = NixlKVSender(config, src_cache)
    try:
        tid = receiver.open([3, 7, 9], deadline_s=10)
        src = reader(src_cache)
        sender.send(
            TransferRequest(receiver.endpoint, tid, [1, 2, 5], NUM_LAYERS, src, CommitInfo(1))
        )
        opened = _listening() - before  # the KV endpoint's and both agents' UCX listeners
        loopback = all(ip.removeprefix("::ffff:") == "127.0.0.1" for ip, _ in opened)
        assert len(opened) >= 3 and loopback, opened
    finally:
        sender.close()
        receiver.stop()
