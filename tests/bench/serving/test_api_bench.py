"""`pdserve bench api`'s CPU accounting and where its clients run."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from pdserve.bench.serving.api_bench import (
    GRPC_CLIENT_EXPERIMENTS,
    _configure_client_process,
    client_process,
    router_cpu_now,
    run_client,
)


def spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_router_thread_cpu_is_counted_apart_from_the_rest_of_the_process() -> None:
    go, spun, leave = threading.Event(), threading.Event(), threading.Event()
    ident: list[int] = []

    def router() -> None:
        ident.append(threading.get_ident())
        go.wait()
        spin(0.3)
        spun.set()
        leave.wait()  # a thread's CPU clock is readable while the thread lives

    thread = threading.Thread(target=router)
    thread.start()
    while not ident:
        time.sleep(0.01)
    clock = time.pthread_getcpuclockid(ident[0])
    before = router_cpu_now(clock)
    go.set()
    spun.wait()
    spin(0.1)  # another thread of the router's process
    after = router_cpu_now(clock)
    leave.set()
    thread.join()
    router, process = (b - a for a, b in zip(before, after, strict=True))
    assert 0.3 <= router < 0.38
    assert process >= router + 0.1 - 0.01


def test_clients_run_in_a_process_of_their_own_that_reports_its_cpu() -> None:
    """A gRPC client in the router's process would share its grpc.aio completion poller."""
    with client_process() as clients:
        assert clients.submit(os.getpid).result() != os.getpid()
        for api, address in (("grpc", "127.0.0.1:1"), ("http", "http://127.0.0.1:1/v1")):
            records, cpu_s = clients.submit(run_client, api, address, "m", [], {}).result()
            assert records == []
            assert 0 <= cpu_s < 5


def test_the_client_process_turns_grpc_cores_event_engine_client_off(monkeypatch) -> None:
    """gRPC reads GRPC_EXPERIMENTS once, at import: the client process sets it first, and
    keeps what the caller's environment already asked for."""
    monkeypatch.setenv("GRPC_EXPERIMENTS", "-event_engine_dns")
    with client_process() as clients:
        experiments = clients.submit(os.getenv, "GRPC_EXPERIMENTS").result()
    assert experiments.split(",") == ["-event_engine_dns", GRPC_CLIENT_EXPERIMENTS]
    with client_process(grpc_experiments="") as clients:  # --grpc-event-engine-client
        assert clients.submit(os.getenv, "GRPC_EXPERIMENTS").result() == "-event_engine_dns"


def test_settings_made_after_grpc_was_imported_are_refused(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "grpc", sys.modules.get("grpc", object()))
    with pytest.raises(RuntimeError, match="before"):
        _configure_client_process(GRPC_CLIENT_EXPERIMENTS)
