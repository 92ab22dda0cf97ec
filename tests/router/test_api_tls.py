"""TLS and mutual TLS on the client API, with a throwaway CA; the client and `pdserve generate`."""

from __future__ import annotations

import argparse
import os

import grpc
import pytest

from pdserve.client import AsyncGenerationClient, GenerationClient, GenerationError
from pdserve.commands import generate as generate_command
from router.tls import server_credentials
from tests.router.api_server import ApiServer
from tests.router.tls_certs import TestCA


@pytest.fixture
def ca(tmp_path) -> TestCA:
    return TestCA(tmp_path)


def _generate_args(target: str, *flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    generate_command.add_arguments(parser)
    return parser.parse_args(["Hello", "--target", target, "--timeout", "10", *flags])


def test_tls_call_with_the_servers_ca(tmp_path, ca, capsys):
    server_cert = ca.issue("router", server=True)
    credentials = server_credentials(server_cert.cert, server_cert.key)
    with ApiServer(tmp_path, credentials=credentials) as server:
        with GenerationClient(server.target, tls_ca=ca.cert, timeout=10) as client:
            assert client.model_info().name == "tiny"
            assert client.tokenize("hello")
        # A plaintext client does not get through.
        with (
            GenerationClient(server.target, timeout=10) as plain,
            pytest.raises(GenerationError) as error,
        ):
            plain.model_info()
        assert error.value.code == grpc.StatusCode.UNAVAILABLE
        # The CLI over TLS: the server's answer (here: a validation error) arrives.
        args = _generate_args(server.target, "--tls-ca", str(ca.cert), "--max-tokens", "5000")
        assert generate_command.run(args) == 1
    assert "INVALID_ARGUMENT: sampling.max_tokens" in capsys.readouterr().err


def test_mutual_tls_refuses_a_client_without_a_certificate(tmp_path, ca):
    server_cert = ca.issue("router", server=True)
    client_cert = ca.issue("client", server=False)
    stranger_cert = TestCA(tmp_path, "another CA").issue("stranger", server=False)
    credentials = server_credentials(server_cert.cert, server_cert.key, client_ca_file=ca.cert)

    async def async_model_name(target: str) -> str:
        async with AsyncGenerationClient(
            target, tls_ca=ca.cert, tls_cert=client_cert.cert, tls_key=client_cert.key, timeout=10
        ) as client:
            return (await client.model_info()).name

    with ApiServer(tmp_path, credentials=credentials) as server:
        with GenerationClient(
            server.target,
            tls_ca=ca.cert,
            tls_cert=client_cert.cert,
            tls_key=client_cert.key,
            timeout=10,
        ) as client:
            assert client.model_info().name == "tiny"
        assert server.run(async_model_name(server.target)) == "tiny"
        for refused in (
            {"tls_ca": ca.cert},
            {"tls_ca": ca.cert, "tls_cert": stranger_cert.cert, "tls_key": stranger_cert.key},
        ):
            with (
                GenerationClient(server.target, timeout=10, **refused) as client,
                pytest.raises(GenerationError) as error,
            ):
                client.model_info()
            assert error.value.code == grpc.StatusCode.UNAVAILABLE


def test_a_client_certificate_needs_its_key(ca):
    cert = ca.issue("client", server=False)
    with pytest.raises(ValueError, match="tls_cert and tls_key"):
        GenerationClient("127.0.0.1:1", tls_ca=ca.cert, tls_cert=cert.cert)


def test_a_certificate_renewed_in_place_is_served_without_a_restart(tmp_path):
    serving = tmp_path / "serving"
    serving.mkdir()
    cert, key = serving / "tls.crt", serving / "tls.key"

    def install(ca: TestCA) -> None:
        issued = ca.issue("router", server=True)
        for source, target in ((issued.cert, cert), (issued.key, key)):
            staged = target.with_suffix(".new")
            staged.write_bytes(source.read_bytes())
            os.replace(staged, target)  # as the kubelet swaps a Secret volume's files

    cas = []
    for name in ("first", "renewed"):
        (tmp_path / name).mkdir()
        cas.append(TestCA(tmp_path / name, f"{name} CA"))
    first, renewed = cas
    install(first)
    with ApiServer(tmp_path, credentials=server_credentials(cert, key)) as server:
        with GenerationClient(server.target, tls_ca=first.cert, timeout=10) as client:
            assert client.model_info().name == "tiny"
        install(renewed)
        with GenerationClient(server.target, tls_ca=renewed.cert, timeout=10) as client:
            assert client.model_info().name == "tiny"
        with (
            GenerationClient(server.target, tls_ca=first.cert, timeout=10) as stale,
            pytest.raises(GenerationError) as error,
        ):
            stale.model_info()
        assert error.value.code == grpc.StatusCode.UNAVAILABLE
