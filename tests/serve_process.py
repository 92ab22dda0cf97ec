"""`pdserve serve` as a real subprocess in its own process group, as a terminal runs it: its
output lines as they come, Ctrl-C sent to the whole group, and its process tree."""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import psutil


class ServeProcess:
    def __init__(self, *argv: str, env: dict[str, str] | None = None) -> None:
        self.lines: list[tuple[float, str]] = []  # (time.monotonic(), line)
        self._changed = threading.Condition()
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", "serve", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group, as a shell's foreground job
            env={**os.environ, "PDSERVE_REDIS_URL": "", **(env or {})},
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            with self._changed:
                self.lines.append((time.monotonic(), line.rstrip("\n")))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def wait_for(self, pattern: str, timeout: float = 240.0) -> str:
        """The first output line matching `pattern`; AssertionError (with the output) if the
        process ends or `timeout` passes first."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                found = next((ln for _, ln in self.lines if re.search(pattern, ln)), None)
                if found is not None:
                    return found
                left = deadline - time.monotonic()
                ended = self.process.poll() is not None and not self._reader.is_alive()
                assert left > 0 and not ended, f"no line matching {pattern!r}:\n{self.text()}"
                self._changed.wait(min(left, 0.5))

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def interrupt(self, timeout: float = 30.0) -> tuple[float, list[str], list[psutil.Process]]:
        """Ctrl-C to the process group: (seconds until the process exited, the output lines
        after the signal, the processes of its tree still running a second later)."""
        tree = self.descendants()
        sent = time.monotonic()
        os.killpg(self.process.pid, signal.SIGINT)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            # Rare (a few CI runs in dozens, never reproduced by hand): what each thread was
            # doing is what tells where the Ctrl-C went, so it is taken before the kill.
            # One such run printed its "stopped" line 1.1 s after the signal, then was not
            # reaped for 30 s and py-spy found nothing to read: a process stuck exiting, which
            # the kernel's view of its threads (state, wait channel) shows.
            raise AssertionError(
                f"still running {timeout:.0f} s after Ctrl-C; its threads:\n"
                f"{_thread_states(self.process.pid)}\n{_thread_stacks(self.process.pid)}\n"
                f"its output:\n{self.text()}"
            ) from None
        finally:
            exited = time.monotonic() - sent
            self.kill()
        # Returns as soon as the whole tree is gone; what still runs a second later is left.
        _, running = psutil.wait_procs(tree, timeout=1.0)
        return exited, [ln for t, ln in self.lines if t >= sent], [p for p in running if _alive(p)]

    def kill(self) -> None:
        """Whatever of the tree is still there (a failed test's cleanup; none normally), then
        the rest of its output: lines written just before it exited (a traceback printed at
        exit) are still in the pipe when the process is reaped."""
        for process in self.descendants():
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(10)
        self._reader.join(5)


def _thread_stacks(pid: int) -> str:
    """Every thread's Python and native stack (py-spy, which Ray's default extra installs)."""
    py_spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    try:
        dump = subprocess.run(
            [py_spy, "dump", "--native", "--pid", str(pid)],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"(no stacks: {e})"
    return dump.stdout + dump.stderr


def _thread_states(pid: int) -> str:
    """Each thread's state and kernel wait channel (/proc), which a process stuck exiting
    still has when py-spy can no longer read its memory."""
    lines = []
    for task in sorted(glob.glob(f"/proc/{pid}/task/*")):
        try:
            with open(f"{task}/stat") as stat, open(f"{task}/wchan") as wchan:
                comm_state = stat.read().split(") ", 1)
                state = comm_state[1].split()[0] if len(comm_state) == 2 else "?"
                lines.append(
                    f"thread {os.path.basename(task)} {comm_state[0]}) {state} {wchan.read()}"
                )
        except OSError as e:
            lines.append(f"thread {os.path.basename(task)}: {e}")
    return "\n".join(lines) or f"(no threads under /proc/{pid})"


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
