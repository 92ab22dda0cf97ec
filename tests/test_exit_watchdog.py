"""pdserve/exit_watchdog.py: a process that can run no thread at all (stopped, as one blocked
with the GIL held is for its own threads) is still ended, with its descendants, and says so."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

STOPS_ITSELF = """
import os, signal, subprocess, sys
from pdserve.exit_watchdog import start_exit_watchdog
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(child.pid, flush=True)
start_exit_watchdog(1.0)
os.kill(os.getpid(), signal.SIGSTOP)
"""


def test_a_process_that_cannot_run_is_killed_with_its_children_and_says_so():
    process = subprocess.Popen(
        [sys.executable, "-c", STOPS_ITSELF],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    child = int(process.stdout.readline())
    assert process.wait(timeout=30) == -9  # SIGKILL, while stopped
    assert "pdserve serve: interrupted during start-up" in process.stderr.read()
    assert not _running(child)


def _running(pid: int, within_s: float = 5.0) -> bool:
    """Still running `within_s` from now (a killed orphan is a zombie until init reaps it)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            return False
        time.sleep(0.1)
    return True
