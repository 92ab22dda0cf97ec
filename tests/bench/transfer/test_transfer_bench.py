"""`pdserve bench transfer` through the real CLI: its receiver runs in a spawned process, so
what it is handed must pickle (the parsed arguments, holding the CLI parser's own objects, did
not, and the command failed before measuring anything)."""

from __future__ import annotations

import re
import subprocess
import sys


def test_bench_transfer_measures_each_transport_against_raw_tcp():
    command = [sys.executable, "-m", "pdserve.cli", "bench", "transfer"]
    flags = ["--kv-transport", "grpc", "collective", "--mb", "1", "--repeats", "1"]
    done = subprocess.run(command + flags, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    for transport in ("grpc", "collective"):
        assert re.search(rf"^\s+{transport}\s+:.*GB/s.*raw TCP.*ratio \d", done.stdout, re.M), (
            done.stdout
        )
