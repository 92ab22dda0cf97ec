"""Notes that local `pdserve serve` processes leave so `pdserve stats` finds their private Redis.

One file per serving process, `<cache dir>/redis-urls/<pid>.json` holding the Redis URL, the
router's port and the pid. Keyed by process, so two servers on one machine never overwrite
each other's note, and a second server that fails to start never removes the first one's.
The URL carries the Redis password: the directory is mode 0700 and each file 0600.
`pdserve stats` picks the note of the router port it is given, or the only live one; notes of
processes that are gone (killed before they could remove theirs) are ignored and deleted.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from pdserve.config import default_cache_dir


@dataclass(frozen=True)
class LocalServer:
    url: str
    router_port: int  # 0 when the router was told to pick an ephemeral port
    pid: int
    path: Path


def notes_dir() -> Path:
    """Where the notes live (read at each call: $PDSERVE_CACHE_DIR may change)."""
    return default_cache_dir() / "redis-urls"


def advertise(url: str, router_port: int, pid: int | None = None) -> Path:
    """Writes this process's note (mode 0600) and returns its path, for `withdraw`."""
    pid = os.getpid() if pid is None else pid
    directory = notes_dir()
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    directory.chmod(0o700)
    path = directory / f"{pid}.json"
    temporary = path.with_suffix(".tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"url": url, "router_port": router_port, "pid": pid}, f)
    temporary.replace(path)  # readers never see half a note
    return path


def withdraw(path: Path) -> None:
    path.unlink(missing_ok=True)


def live_servers() -> list[LocalServer]:
    """The notes of processes that still run, by router port; stale ones are deleted."""
    servers = []
    for path in sorted(notes_dir().glob("*.json")):
        try:
            note = json.loads(path.read_text())
            server = LocalServer(str(note["url"]), int(note["router_port"]), int(note["pid"]), path)
        except (OSError, ValueError, KeyError, TypeError):
            continue  # unreadable or being replaced: not a server we can use
        if _alive(server.pid):
            servers.append(server)
        else:
            withdraw(path)
    return sorted(servers, key=lambda s: (s.router_port, s.pid))


def find_local_url(router_port: int | None = None) -> str | None:
    """The Redis URL of the local server on `router_port`, or of the only one running; None
    when no local server noted one. Raises LookupError (a message for the user) when the port
    matches none, or several run and no port says which."""
    servers = live_servers()
    if router_port is not None:
        for server in servers:
            if server.router_port == router_port:
                return server.url
        raise LookupError(
            f"no pdserve server at router port {router_port}: is `pdserve serve` running? "
            f"(--target; local servers' router ports: {_ports(servers) or 'none'})"
        )
    if len(servers) > 1:
        raise LookupError(
            f"{len(servers)} local `pdserve serve` processes run (router ports "
            f"{_ports(servers)}): pick one with --target"
        )
    return servers[0].url if servers else None


def _ports(servers: list[LocalServer]) -> str:
    return ", ".join(str(s.router_port) if s.router_port else f"pid {s.pid}" for s in servers)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True
