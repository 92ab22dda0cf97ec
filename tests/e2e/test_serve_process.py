"""`pdserve serve` as a process: stopped by SIGTERM while streams run, it exits within the drain
time, starts no Ray anew for the cancelled requests' aborts and logs no error; its secrets
reach none of the local Ray processes."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import httpx
import psutil

from pdserve.pb import generate_pb2, generate_pb2_grpc
from tests.serve_process import ServeProcess

GRACE_S = 2.0
RAY_DAEMONS = ("gcs_server", "raylet", "dashboard")


@dataclass
class Served:
    process: subprocess.Popen
    port: int
    http_port: int
    serving: ServeProcess

    @property
    def output(self) -> str:
        return self.serving.text()


@contextlib.contextmanager
def pdserve_serve(*flags: str, env: dict[str, str] | None = None) -> Iterator[Served]:
    """`pdserve serve` of sim workers on loopback, once it printed its ports."""
    serving = ServeProcess(
        "--engine", "sim", "--sim-time-scale", "20",
        "--prefill-workers", "1", "--decode-workers", "1", "--disaggregate", "always",
        "--host", "127.0.0.1", "--port", "0", "--http-host", "127.0.0.1", "--http-port", "0",
        "--kv-bind-host", "127.0.0.1", "--kv-advertise-host", "127.0.0.1", *flags,
        env=env,
    )  # fmt: skip
    try:
        ready = serving.wait_for(r"gRPC on port \d+")
        port = int(re.search(r"gRPC on port (\d+)", ready).group(1))
        http_port = int(re.search(r"HTTP on port (\d+)", ready).group(1))
        yield Served(serving.process, port, http_port, serving)
    finally:
        serving.kill()


def ray_processes(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def ray_daemons(pid: int) -> set[tuple[int, str]]:
    """(pid, name) of the Ray daemons under process `pid`."""
    found = set()
    for child in ray_processes(pid):
        with contextlib.suppress(psutil.Error):
            command = " ".join(child.cmdline())
            found |= {(child.pid, name) for name in RAY_DAEMONS if name in command}
    return found


def generate(stub, i: int, max_tokens: int, metadata=()):
    request = generate_pb2.GenerateRequest(
        token_ids=generate_pb2.TokenIds(ids=list(range(10 + i, 40 + i))),
        sampling=generate_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )
    return stub.Generate(request, metadata=metadata, timeout=300)


def test_sigterm_with_streams_in_flight_exits_within_the_grace_and_starts_no_ray():
    # Any free HTTP port (the default's 0), read from the ready line: a port picked here first
    # was taken by another process before the server bound it once in 16 runs.
    with (
        pdserve_serve("--shutdown-grace-s", str(GRACE_S)) as served,
        grpc.insecure_channel(f"127.0.0.1:{served.port}") as channel,
        httpx.Client(timeout=300) as http,
    ):
        api = f"http://127.0.0.1:{served.http_port}/v1"
        stub = generate_pb2_grpc.GenerationStub(channel)
        streams = [generate(stub, i, 2000) for i in range(3)]
        for stream in streams:
            next(stream)  # every stream has started
        model = http.get(f"{api}/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": list(range(50, 80)), "max_tokens": 2000, "stream": True}
        with http.stream("POST", f"{api}/completions", json=body) as response:
            assert response.status_code == 200
            next(response.iter_lines())  # an HTTP stream has started too
            before = ray_daemons(served.process.pid)
            assert before, "no Ray daemons under pdserve serve"

            signalled = time.monotonic()
            served.process.send_signal(signal.SIGTERM)
            started_anew: set[tuple[int, str]] = set()
            while served.process.poll() is None and time.monotonic() - signalled < GRACE_S + 60:
                started_anew |= ray_daemons(served.process.pid) - before
                time.sleep(0.05)
            exited_after = time.monotonic() - signalled
    output = served.output
    assert exited_after <= GRACE_S + 5, (exited_after, output[-4000:])
    assert not started_anew, started_anew
    assert "Started a local Ray instance" not in output.split("gRPC on port")[-1]
    for error in ("Traceback", " ERROR ", "Exception not handled", "already running"):
        assert error not in output, output[-4000:]
    assert served.process.returncode == 0, output[-4000:]


def test_api_keys_and_secrets_reach_no_ray_process():
    secrets = {
        "PDSERVE_API_KEYS": "client-key-0f3a9c",
        "PDSERVE_KV_SECRET": "kv-secret-77d2e1",
    }
    with pdserve_serve(env=secrets) as served:
        processes = ray_processes(served.process.pid)
        assert len(processes) >= 4  # gcs_server, raylet, the two workers and more
        environments = []
        for process in processes:
            with contextlib.suppress(psutil.Error):
                environments.append(" ".join(f"{k}={v}" for k, v in process.environ().items()))
        assert environments
        for value in secrets.values():
            assert not [env for env in environments if value in env]
        # The router still has the keys: a call without one is refused, one with it served.
        with grpc.insecure_channel(f"127.0.0.1:{served.port}") as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            try:
                list(generate(stub, 0, 2))
                refused = None
            except grpc.RpcError as error:
                refused = error.code()
            assert refused == grpc.StatusCode.UNAUTHENTICATED
            key = (("authorization", "Bearer client-key-0f3a9c"),)
            assert len([t for r in generate(stub, 0, 2, key) for t in r.token_ids]) == 2
