"""`pdserve bench disk-demotion`: both ways demote every block past the host's slots, through
real files, and the writer-thread way's queue drains."""

from __future__ import annotations

import pytest

from pdserve.bench.engine.disk_demotion_bench import demote


@pytest.mark.parametrize("synchronous", [True, False])
def test_each_way_demotes_every_block_to_a_file(tmp_path, synchronous):
    result = demote(8, blocks=12, interval_s=0.0, base_dir=str(tmp_path), synchronous=synchronous)
    assert len(result.seconds) == 12 and all(s > 0 for s in result.seconds)
    assert result.dropped == 0  # 64 MiB of queue: thousands of 8 KiB blocks
    (run,) = tmp_path.glob("run-*")
    assert len(list(run.glob("*.kv"))) == 12 and not list(run.glob("*.tmp"))
