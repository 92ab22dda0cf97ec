"""`pdserve bench api`'s CPU accounting: each thread's CPU time lands in its own part."""

from __future__ import annotations

import threading
import time

from pdserve.bench.api_bench import CPU_PARTS, cpu_now


def spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_cpu_time_is_split_between_the_client_and_router_threads() -> None:
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
    before = cpu_now(clock)
    go.set()
    spun.wait()  # the client's thread waits while the router's thread spends
    spin(0.1)
    after = cpu_now(clock)
    leave.set()
    thread.join()
    spent = {part: b - a for part, a, b in zip(CPU_PARTS, before, after, strict=True)}
    assert spent["router"] >= 0.3
    assert 0.1 <= spent["client"] < 0.25
    assert spent["process"] >= spent["client"] + spent["router"] - 0.01
