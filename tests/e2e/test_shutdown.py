"""`pdserve serve` stopped by SIGTERM while streams run: it exits within the drain time, starts
no Ray anew for the cancelled requests' aborts, and logs no error."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import psutil

from pdserve.pb import generate_pb2, generate_pb2_grpc

GRACE_S = 2.0
RAY_DAEMONS = ("gcs_server", "raylet", "dashboard")


def ray_daemons(pid: int) -> set[tuple[int, str]]:
    """(pid, name) of the Ray daemons under process `pid`."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return set()
    found = set()
    for child in children:
        try:
            command = " ".join(child.cmdline())
        except psutil.Error:
            continue
        found |= {(child.pid, name) for name in RAY_DAEMONS if name in command}
    return found


def read_lines(stream, lines: list[str]) -> None:
    for line in stream:
        lines.append(line)


def test_sigterm_with_streams_in_flight_exits_within_the_grace_and_starts_no_ray():
    repo = Path(__file__).resolve().parents[2]
    command = [
        sys.executable, "-m", "pdserve.cli", "serve",
        "--engine", "sim", "--sim-time-scale", "20",
        "--prefill-workers", "1", "--decode-workers", "1", "--disaggregate", "always",
        "--host", "127.0.0.1", "--port", "0", "--http-host", "127.0.0.1", "--http-port", "0",
        "--kv-bind-host", "127.0.0.1", "--kv-advertise-host", "127.0.0.1",
        "--shutdown-grace-s", str(GRACE_S),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(repo)}
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    lines: list[str] = []
    reader = threading.Thread(target=read_lines, args=(process.stdout, lines), daemon=True)
    reader.start()
    try:
        port = None
        deadline = time.monotonic() + 240
        while port is None and time.monotonic() < deadline and process.poll() is None:
            found = [re.search(r"serving on port (\d+)", line) for line in lines]
            port = next((int(m.group(1)) for m in found if m), None)
            time.sleep(0.2)
        assert port, "".join(lines)
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        stub = generate_pb2_grpc.GenerationStub(channel)
        streams = [
            stub.Generate(
                generate_pb2.GenerateRequest(
                    token_ids=generate_pb2.TokenIds(ids=list(range(10 + i, 40 + i))),
                    sampling=generate_pb2.SamplingParams(max_tokens=2000, ignore_eos=True),
                ),
                timeout=300,
            )
            for i in range(4)
        ]
        for stream in streams:
            next(stream)  # every stream has started
        before = ray_daemons(process.pid)
        assert before, "no Ray daemons under pdserve serve"

        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        started_anew: set[tuple[int, str]] = set()
        while process.poll() is None and time.monotonic() - signalled < GRACE_S + 60:
            started_anew |= ray_daemons(process.pid) - before
            time.sleep(0.05)
        exited_after = time.monotonic() - signalled
        channel.close()
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(30)
        reader.join(10)
    output = "".join(lines)
    assert exited_after <= GRACE_S + 5, (exited_after, output[-4000:])
    assert not started_anew, started_anew
    assert "Started a local Ray instance" not in output.split("serving on port")[-1]
    for error in ("Traceback", " ERROR ", "Exception not handled", "already running"):
        assert error not in output, output[-4000:]
    assert process.returncode == 0, output[-4000:]
