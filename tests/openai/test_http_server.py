"""The uvicorn server of the HTTP API: binding, TLS with the gRPC API's files, stopping."""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
import time

import httpx
import pytest
from fastapi import FastAPI

from router.http.server import HttpServer
from tests.router.tls_certs import TestCA, certificate_of, install, served_certificate


def probe_app() -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    return app


async def get(url: str, **client_args) -> httpx.Response:
    async with httpx.AsyncClient(**client_args) as client:
        return await client.get(url, timeout=10)


def test_serves_on_a_free_port_and_stops() -> None:
    async def main() -> None:
        server = HttpServer(probe_app(), "127.0.0.1", 0)
        await server.start()
        assert server.port > 0
        assert (await get(f"http://127.0.0.1:{server.port}/health")).json() == {"status": "ok"}
        await server.stop(1)
        with pytest.raises(httpx.ConnectError):
            await get(f"http://127.0.0.1:{server.port}/health")

    asyncio.run(main())


def test_a_busy_port_is_an_os_error() -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]

        async def main() -> None:
            with pytest.raises(OSError):
                await HttpServer(probe_app(), "127.0.0.1", port).start()

        asyncio.run(main())


def test_tls_and_mutual_tls_use_the_grpc_apis_files(tmp_path) -> None:
    ca = TestCA(tmp_path)
    server_cert, client_cert = ca.issue("router", server=True), ca.issue("client", server=False)

    async def main() -> None:
        server = HttpServer(
            probe_app(),
            "127.0.0.1",
            0,
            tls_cert=str(server_cert.cert),
            tls_key=str(server_cert.key),
        )
        await server.start()
        url = f"https://127.0.0.1:{server.port}/health"
        assert (
            await get(url, verify=ssl.create_default_context(cafile=ca.cert))
        ).status_code == 200
        with pytest.raises(httpx.ConnectError):  # an untrusted server certificate
            await get(url)
        await server.stop(1)

        mutual = HttpServer(
            probe_app(),
            "127.0.0.1",
            0,
            tls_cert=str(server_cert.cert),
            tls_key=str(server_cert.key),
            tls_client_ca=str(ca.cert),
        )
        await mutual.start()
        url = f"https://127.0.0.1:{mutual.port}/health"
        context = ssl.create_default_context(cafile=ca.cert)
        with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
            await get(url, verify=context)  # no client certificate
        context.load_cert_chain(client_cert.cert, client_cert.key)
        assert (await get(url, verify=context)).status_code == 200
        await mutual.stop(1)

    asyncio.run(main())


def test_stream_events_on_a_kept_alive_connection_leave_as_they_are_made() -> None:
    """Nagle's algorithm must be off: else each small event of a second request on the same
    connection waits for the client's delayed ACK (up to 40 ms) and tokens arrive in bursts."""
    from fastapi.responses import StreamingResponse

    app = FastAPI()

    @app.get("/events")
    async def events() -> StreamingResponse:
        async def produce():
            for _ in range(10):
                await asyncio.sleep(0.002)
                yield f"data: {time.perf_counter()}\n\n"

        return StreamingResponse(produce(), media_type="text/event-stream")

    loop = asyncio.new_event_loop()
    server = HttpServer(app, "127.0.0.1", 0)
    loop.run_until_complete(server.start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as client:
            for _ in range(3):  # the first request rides on TCP's quick ACKs; the others not
                client.sendall(b"GET /events HTTP/1.1\r\nHost: test\r\n\r\n")
                delays, buffer = [], b""
                while not buffer.endswith(b"0\r\n\r\n"):
                    data = client.recv(65536)
                    now = time.perf_counter()
                    buffer += data
                    for sent in data.split(b"data: ")[1:]:
                        delays.append(now - float(sent.split(b"\n")[0]))
            delays.sort()
            assert len(delays) == 10
            assert delays[len(delays) // 2] < 0.015, delays
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(1), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


@pytest.mark.parametrize("mutual", [False, True])
def test_a_certificate_renewed_in_place_is_served_to_new_connections(tmp_path, mutual) -> None:
    ca = TestCA(tmp_path)
    first, renewed = ca.issue("router", server=True), ca.issue("router-renewed", server=True)
    client = ca.issue("client", server=False) if mutual else None
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    install(first, cert, key)
    client_ca = str(ca.cert) if mutual else None

    async def main() -> None:
        server = HttpServer(
            probe_app(),
            "127.0.0.1",
            0,
            tls_cert=str(cert),
            tls_key=str(key),
            tls_client_ca=client_ca,
        )
        await server.start()
        try:
            served = await asyncio.to_thread(served_certificate, server.port, client)
            assert served == certificate_of(first)
            install(renewed, cert, key)
            # The first connection after the renewal already gets the new certificate, and so
            # do the later ones (with the client certificate checked, under mutual TLS).
            for _ in range(2):
                served = await asyncio.to_thread(served_certificate, server.port, client)
                assert served == certificate_of(renewed)
            verify = ssl.create_default_context(cafile=ca.cert)
            if client:
                verify.load_cert_chain(client.cert, client.key)
            url = f"https://127.0.0.1:{server.port}/health"
            assert (await get(url, verify=verify)).status_code == 200
        finally:
            await server.stop(1)

    asyncio.run(main())
