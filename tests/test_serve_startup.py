"""`pdserve serve` started as a user starts it: progress lines and no Ray noise, Ctrl-C at any
moment of start-up, and a private Ray even beside another cluster on the machine."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from tests.serve_process import ServeProcess
from tests.test_cli import model_dir  # noqa: F401 - the fixture

EXIT_S = 5.0  # Ctrl-C: the process is gone within this
PROGRESS = [
    r"^settings and ports checked; float32 runs on cpu \(\d+\.\d s\)$",
    r"^Ray started \(private to this server, \d+ CPUs\) \(\d+\.\d s\)$",
    r"^Redis started on 127\.0\.0\.1:\d+ \(private\) \(\d+\.\d s\)$",
    r"^model \w+ \(\d+\.\d KiB of weights\): loading in 1 prefill and 1 decode workers",
    r"^prefill worker 1/1 healthy \(\d+\.\d s\)$",
    r"^decode worker 1/1 healthy \(\d+\.\d s\)$",
    r"^pdserve ready in \d+\.\d s: gRPC on port \d+, HTTP on port \d+ \(1/1 prefill, 1/1 decode",
]
# What Ray and pdserve's components print at INFO, and Ray's colour codes and dedup hints.
NOISE = [
    "\x1b[",
    "Token authentication",
    " INFO ",
    "Started a local Ray",
    "repeated",
    "pdserve.heap",
]


def serve(model: str, *flags: str, env: dict[str, str] | None = None) -> ServeProcess:
    return ServeProcess("--model", model, "--port", "0", "--http-port", "0", *flags, env=env)


def assert_stopped_cleanly(server: ServeProcess) -> None:
    seconds, lines, left = server.interrupt()
    assert seconds <= EXIT_S, f"exited {seconds:.1f} s after Ctrl-C:\n{server.text()}"
    assert len(lines) == 1 and lines[0].startswith("pdserve serve: "), server.text()
    assert left == [], f"left running: {[p.cmdline()[:1] for p in left]}"


def test_start_up_says_what_it_does_without_ray_noise_and_ctrl_c_after_ready(model_dir):  # noqa: F811
    server = serve(str(model_dir))
    try:
        server.wait_for(r"^pdserve ready")
        output = server.text()
        for pattern in PROGRESS:
            server.wait_for(pattern, timeout=0.1)
        assert not [noise for noise in NOISE if noise in output], output
        assert_stopped_cleanly(server)
    finally:
        server.kill()


@pytest.mark.parametrize(
    "moment",
    [
        "^settings and ports checked",  # Ray starting
        "^Ray started",  # the private Redis starting, then the workers
        "^model ",  # the workers loading the model
    ],
)
def test_ctrl_c_during_start_up_stops_everything_at_once(model_dir, moment):  # noqa: F811
    server = serve(str(model_dir))
    try:
        server.wait_for(moment)
        if moment == "^model ":
            time.sleep(2.0)  # the worker processes are up and importing
        assert_stopped_cleanly(server)
    finally:
        server.kill()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture()
def other_cluster():
    """A `ray start --head` cluster on this machine, as someone else's would be, with no pool
    resources; its temporary directory holds the address file a plain ray.init() joins
    (yielded as the environment that finds it). Stopped by its process group, never with
    `ray stop`, which would stop every cluster on the machine."""
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Unix socket paths
    port = free_port()
    head = subprocess.Popen(
        [
            os.path.join(os.path.dirname(sys.executable), "ray"),
            "start",
            "--head",
            "--block",
            f"--port={port}",
            f"--temp-dir={temp_dir}",
            "--num-cpus=1",
            "--include-dashboard=false",
            "--disable-usage-stats",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(os.path.join(temp_dir, "ray_current_cluster")):
            assert head.poll() is None and time.monotonic() < deadline, "ray start failed"
            time.sleep(0.5)
        yield address, {"RAY_TMPDIR": temp_dir, "RAY_ADDRESS": address}
    finally:
        os.killpg(head.pid, signal.SIGKILL)
        head.wait(10)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_serve_starts_its_own_ray_beside_another_cluster(model_dir, other_cluster):  # noqa: F811
    address, env = other_cluster
    server = serve(str(model_dir), env=env)
    try:
        server.wait_for(r"^pdserve ready")
        server.wait_for(r"^Ray started \(private to this server", timeout=0.1)
        assert_stopped_cleanly(server)
    finally:
        server.kill()
    # Given as --ray-address, the same cluster is refused for what it lacks, in one line.
    # Ray joins an explicit address with token authentication only when told to.
    flags = ("--ray-address", address, "--ray-resources-wait-s", "0")
    server = serve(str(model_dir), *flags, env={"RAY_AUTH_MODE": "token"})
    try:
        assert server.process.wait(60) == 1
        server._reader.join(5)
        assert [line for _, line in server.lines][-1] == (
            f"pdserve serve: error: --ray-address {address}: the cluster lacks the pools' "
            "resources: needs prefill_pool 1, decode_pool 1; has prefill_pool 0, decode_pool 0 "
            "(see --prefill-pool-resource, --decode-pool-resource)"
        ), server.text()
        assert "Traceback" not in server.text()
    finally:
        server.kill()
