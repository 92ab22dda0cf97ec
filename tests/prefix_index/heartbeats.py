"""Waiting for a worker's heartbeat to lapse, instead of sleeping a fixed time past its TTL.

A fixed sleep makes the TTL a race: short enough for the sleep to be cheap, it can lapse before
the test's first "still alive" check on a loaded CI machine. Tests give such workers a TTL that
outlasts any pause (LAPSING_TTL_S) and wait here for the key to be gone."""

from __future__ import annotations

import time

import redis

from pdserve.prefix_index.publisher import PrefixIndexPublisher

LAPSING_TTL_S = 1.5


def wait_lapsed(url: str, pub: PrefixIndexPublisher, timeout_s: float = 10.0) -> None:
    client = redis.Redis.from_url(url)
    key = pub.keys.heartbeat(pub.worker_id)
    deadline = time.monotonic() + timeout_s
    while client.exists(key) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not client.exists(key), f"{pub.worker_id}'s heartbeat did not lapse in {timeout_s} s"
