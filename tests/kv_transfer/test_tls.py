"""KV transfer over TLS between workers: a throwaway CA, real handshakes on 127.0.0.1."""

from __future__ import annotations

import dataclasses

import grpc
import pytest
import torch

from kv_transfer import (
    CommitInfo,
    KVLayout,
    KVTransferError,
    TransferRequest,
    make_receiver,
    make_sender,
)
from kv_transfer.grpc_common import SERVICE
from pdserve.pb import kv_transfer_pb2 as pb
from tests.kv_transfer.conftest import SECRET
from tests.kv_transfer.kv_helpers import NUM_LAYERS, make_cache, reader
from tests.router.tls_certs import TestCA, certificate_of, install, served_certificate

SRC, DEST = [1, 2, 5], [3, 7, 9]


@pytest.fixture
def certs(tmp_path):
    ca = TestCA(tmp_path)
    return ca, ca.issue("decode-0", server=True), ca.issue("prefill-0", server=False)


def with_tls(config, ca, issued, **more):
    return dataclasses.replace(
        config, tls_cert=str(issued.cert), tls_key=str(issued.key), tls_ca=str(ca.cert), **more
    )


def send(sender, receiver, tid):
    read_kv = reader(make_cache(1))
    sender.send(TransferRequest(receiver.endpoint, tid, SRC, NUM_LAYERS, read_kv, CommitInfo(42)))


@pytest.mark.parametrize("transport", ["grpc", "collective"])
def test_transfer_over_mutual_tls_arrives_bit_exact(config, sink, certs, transport):
    ca, server, client = certs
    config = dataclasses.replace(config, transport=transport)
    receiver = make_receiver(with_tls(config, ca, server), sink, KVLayout.of(sink.cache))
    receiver.start()
    sender = make_sender(with_tls(config, ca, client))
    try:
        tid = receiver.open(DEST, deadline_s=10)
        send(sender, receiver, tid)
    finally:
        sender.close()
        receiver.stop()
    assert torch.equal(sink.cache[:, :, DEST], make_cache(1)[:, :, SRC])
    assert sink.commits[tid].first_token_id == 42


def abort_over(channel: grpc.Channel) -> None:
    abort = channel.unary_unary(
        f"/{SERVICE}/Abort",
        request_serializer=pb.AbortRequest.SerializeToString,
        response_deserializer=pb.AbortResponse.FromString,
    )
    abort(pb.AbortRequest(transfer_id="x"), timeout=5, metadata=(("x-pdserve-kv-secret", SECRET),))


@pytest.mark.parametrize("client_auth", [True, False])
def test_peers_without_the_ca_or_a_certificate_are_refused(
    config, sink, certs, tmp_path, client_auth
):
    ca, server, client = certs
    receiver_config = with_tls(config, ca, server, tls_client_auth=client_auth)
    receiver = make_receiver(receiver_config, sink, KVLayout.of(sink.cache))
    receiver.start()
    (tmp_path / "other").mkdir()
    other_ca = TestCA(tmp_path / "other", name="other CA")
    impostor = other_ca.issue("impostor", server=False)
    try:
        tid = receiver.open(DEST, deadline_s=10)
        for peer in (config, with_tls(config, other_ca, impostor)):  # plaintext; unknown CA
            sender = make_sender(peer)
            with pytest.raises(KVTransferError, match="UNAVAILABLE"):
                send(sender, receiver, tid)
            sender.close()
        # Trusts the CA but has no certificate of its own: refused only under mutual TLS.
        anonymous = grpc.ssl_channel_credentials(root_certificates=ca.cert.read_bytes())
        with grpc.secure_channel(receiver.endpoint, anonymous) as channel:
            if client_auth:
                with pytest.raises(grpc.RpcError) as info:
                    abort_over(channel)
                assert info.value.code() is grpc.StatusCode.UNAVAILABLE
            else:
                abort_over(channel)
        assert sink.writes == 0 and receiver.open_transfer_ids() == [tid]
    finally:
        receiver.stop()


def test_a_certificate_renewed_in_place_is_served_to_new_connections(config, sink, tmp_path):
    ca = TestCA(tmp_path)
    first, renewed = ca.issue("decode-0", server=True), ca.issue("decode-0-renewed", server=True)
    prefill = ca.issue("prefill-0", server=False)
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    install(first, cert, key)
    receiver_config = dataclasses.replace(
        config, tls_cert=str(cert), tls_key=str(key), tls_ca=str(ca.cert)
    )
    receiver = make_receiver(receiver_config, sink, KVLayout.of(sink.cache))
    receiver.start()
    try:
        port = int(receiver.endpoint.rsplit(":", 1)[1])
        assert served_certificate(port, prefill) == certificate_of(first)
        install(renewed, cert, key)
        assert served_certificate(port, prefill) == certificate_of(renewed)
        # A prefill worker's push still arrives: the renewed certificate verifies.
        tid = receiver.open(DEST, deadline_s=10)
        sender = make_sender(with_tls(config, ca, prefill))
        try:
            send(sender, receiver, tid)
        finally:
            sender.close()
        assert sink.writes > 0
    finally:
        receiver.stop()
