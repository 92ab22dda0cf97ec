"""`bench sim-memory`'s probes, in this process: what a worker actor reports about itself and
the memory of a process tree (the served system end to end: `pdserve bench sim-memory`)."""

from __future__ import annotations

import subprocess
import sys
import time

from pdserve.bench.simulation.sim_memory import _actor_facts, run_memory, summary_line


def test_actor_facts_report_this_process_its_peak_and_whether_torch_is_loaded():
    high = bytearray(256 << 20)  # touched (zeroed), then handed back to the kernel (mmap)
    del high
    facts = _actor_facts(None)
    assert facts["rss"] > 0
    # The high-water mark remembers the 256 MiB the RSS no longer holds.
    assert facts["peak_rss"] >= facts["rss"] + (200 << 20)
    assert facts["torch"] == ("torch" in sys.modules)


def test_run_memory_counts_the_children_of_this_process():
    alone = run_memory()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.5)
        with_child = run_memory()
    finally:
        child.kill()
        child.wait()
    assert with_child["processes"] == alone["processes"] + 1
    assert with_child["rss"] > alone["rss"] and with_child["pss"] > 0


def test_summary_line_gives_the_median_sum_peak_and_torch_count():
    mib = 1 << 20
    measured = {
        "workers": {
            "a": {"rss": 100 * mib, "peak_rss": 120 * mib, "torch": False},
            "b": {"rss": 300 * mib, "peak_rss": 310 * mib, "torch": True},
        },
        "system": {"processes": 5, "rss": 1000 * mib, "pss": 700 * mib},
    }
    line = summary_line("x", measured)
    assert "RSS median 300 MiB, sum 400 MiB, peak of one 310 MiB; torch loaded in 1" in line
    assert "(5 processes): RSS 1000 MiB, PSS 700 MiB" in line
