"""A last resort for Ctrl-C during start-up: a separate process that ends this one's tree if
this one has not exited in time.

A stop step can block this process with the GIL held (`ray.shutdown()` racing a `ray.init`
still running in the start-up thread), and then no thread of it runs, the timer that
`pdserve serve` keeps for the same purpose included: a CI run hung past 30 s with that timer
in place. A process of its own does not share the GIL.
"""

from __future__ import annotations

import os
import subprocess
import sys

_WATCHDOG = """
import os, sys, time
import psutil
pid, seconds = int(sys.argv[1]), float(sys.argv[2])
time.sleep(seconds)
try:
    target = psutil.Process(pid)
    tree = [target, *target.children(recursive=True)]
except psutil.NoSuchProcess:
    sys.exit(0)
for process in tree:
    if process.pid != os.getpid():
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
print(f"pdserve serve: interrupted during start-up; its stop hung, so its processes were "
      f"killed after {seconds:g} s", file=sys.stderr, flush=True)
"""


def start_exit_watchdog(seconds: float) -> subprocess.Popen:
    """Kills this process and its descendants `seconds` from now unless this process is gone
    by then; the caller's own exit kills the watchdog with its other descendants."""
    return subprocess.Popen(
        [sys.executable, "-c", _WATCHDOG, str(os.getpid()), str(seconds)],
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # not in the process group a second Ctrl-C reaches
    )
