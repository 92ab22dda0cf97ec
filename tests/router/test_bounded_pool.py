"""The bounded pool behind tokenizing and body decoding: full means refused at once."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from router.bounded_pool import BoundedPool
from router.types import Overloaded


def test_a_full_pool_refuses_at_once_and_takes_work_again_when_it_drains() -> None:
    release = threading.Event()

    async def main() -> None:
        pool = BoundedPool("tokenize", max_concurrent=1, max_waiting=2)
        held = [asyncio.ensure_future(pool.run(release.wait, 30)) for _ in range(3)]
        await asyncio.sleep(0.1)
        started = time.monotonic()
        with pytest.raises(Overloaded, match="3 tokenize jobs running or queued"):
            await pool.run(time.sleep, 0)
        assert time.monotonic() - started < 0.05
        release.set()
        assert await asyncio.gather(*held) == [True] * 3
        assert pool.outstanding == 0
        assert await pool.run(sum, [1, 2]) == 3
        pool.close()

    asyncio.run(main())
