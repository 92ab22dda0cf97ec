"""The sim engine's host and disk tiers (--kv-offload-gb, --kv-disk-gb on --engine sim): the
engine's own HostTier and DiskTier hold no more blocks than their budgets, and every block
brought back costs its step exactly what its modelled link says (pdserve/sim/kv_tiers.py)."""

from __future__ import annotations

import json
import random

import pytest

from pdserve.core.sampling_params import SamplingParams
from pdserve.planner.deployment import Deployment, StepMeter
from pdserve.sim.kv_tiers import GB, TierLink

BLOCK = 16
DEVICE_BLOCKS, HOST_BLOCKS, DISK_BLOCKS = 24, 8, 16
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


@pytest.fixture
def tiered(planner_model_dir):
    """A sim engine with a host tier of 8 blocks over a disk tier of 16, the meter of its
    steps, and a meter of the same steps' compute alone (under the tiers' charges)."""
    deployment = Deployment(str(planner_model_dir), num_kv_blocks=DEVICE_BLOCKS, block_size=BLOCK)
    engine, meter = deployment.new_engine()
    per_block = engine.bytes_per_block
    engine, meter = deployment.with_engine(
        kv_offload_gb=HOST_BLOCKS * per_block / 2**30,
        kv_disk_gb=DISK_BLOCKS * per_block / 2**30,
    ).new_engine()
    charged = meter.timing  # TierChargedTiming
    compute = StepMeter(charged.timing)
    charged.timing = compute
    return engine, meter, compute


def chat(engine, on_step) -> None:
    """16 conversations of 3 blocks, one more a turn, taken in turn, so each one's blocks leave the device
    (and the host) before it comes back; `on_step()` after every engine step."""
    rng = random.Random(0)
    history = [[rng.randrange(3, 500) for _ in range(2 * BLOCK)] for _ in range(16)]
    for turn in range(3):
        for c, conversation in enumerate(history):
            conversation += [rng.randrange(3, 500) for _ in range(BLOCK - PARAMS.max_tokens)]
            engine.add_request(f"{turn}-{c}", conversation, PARAMS)
            while engine.has_unfinished():
                for out in engine.step():
                    conversation += out.new_token_ids
                on_step()


def test_the_sim_tiers_never_exceed_their_budgets(tiered) -> None:
    engine, _, _ = tiered
    host = engine.host_tier
    assert (host.num_slots, host.disk.index.num_slots) == (HOST_BLOCKS, DISK_BLOCKS)
    most = {"host": 0, "disk": 0}

    def check() -> None:
        host.check_invariants()
        most["host"] = max(most["host"], len(host))
        most["disk"] = max(most["disk"], len(host.disk))

    chat(engine, check)
    assert most == {"host": HOST_BLOCKS, "disk": DISK_BLOCKS}  # both filled, never past
    stats = engine.stats()
    assert stats["host_restored_blocks"] > 0 and stats["disk_restored_blocks"] > 0


def test_a_tier_hit_costs_its_step_the_transfer_on_its_link(tiered) -> None:
    engine, meter, compute = tiered
    per_block = engine.bytes_per_block
    host_link, disk_link = TierLink(50 * GB, 10e-6), TierLink(6 * GB, 100e-6)  # the defaults
    host_block = host_link.seconds(per_block)
    disk_block = disk_link.seconds(per_block) + host_block  # file -> host -> device
    before = {"total": 0.0, "compute": 0.0, "host": 0, "disk": 0}
    charged_steps = []

    def check() -> None:
        stats = engine.stats()
        host = stats["host_restored_blocks"] - before["host"]
        disk = stats["disk_restored_blocks"] - before["disk"]
        step = meter.seconds - before["total"]
        transfer = step - (compute.seconds - before["compute"])
        assert transfer == pytest.approx(host * host_block + disk * disk_block, abs=1e-12)
        if host or disk:
            charged_steps.append((host, disk, transfer))
        before.update(
            total=meter.seconds,
            compute=compute.seconds,
            host=stats["host_restored_blocks"],
            disk=stats["disk_restored_blocks"],
        )

    chat(engine, check)
    assert any(h for h, _, _ in charged_steps) and any(d for _, d, _ in charged_steps)
    stats = engine.stats()
    # What the worker reports and the router prices a hit at: the links' bandwidths.
    assert stats["host_copy_bytes_per_s"] == 50 * GB
    assert stats["disk_read_bytes_per_s"] == int(per_block / disk_block)


def test_bench_sim_kv_tiers_brings_evicted_turns_back_instead_of_recomputing(tmp_path) -> None:
    from pdserve.bench.planner_validation import kv_tiers_offline
    from tests.bench.cli_args import bench_args

    out = tmp_path / "tiers.json"
    args = bench_args(
        kv_tiers_offline, workers=2, rates_per_worker="2", conversations_per_worker=12,
        turns=3, system_prompt_len=256, user_len=128, output_len=16, json=out,
    )  # fmt: skip
    assert kv_tiers_offline.run(args) == 0
    document = json.loads(out.read_text())
    ways = {p["way"]: p for p in document["points"]}
    without, host, disk = ways["without"], ways["host"], ways["disk"]
    assert without["host_restored_blocks"] == without["disk_restored_blocks"] == 0
    # Without a tier, each later turn recomputes its conversation; with one, it is brought back.
    assert without["computed_vs_minimum"] > 1.5
    assert host["computed_vs_minimum"] < 1.2 and host["host_restored_blocks"] > 0
    assert disk["computed_vs_minimum"] < 1.2 and disk["disk_restored_blocks"] > 0
    # A block over PCIe costs less than computing it again, so turns start sooner.
    assert host["ttft_p50_ms"] < without["ttft_p50_ms"]
    # Only the peer way pulls; what it pulls the router priced (tests/planner/test_virtual_pull.py).
    assert without["peer_hit_tokens"] == host["peer_hit_tokens"] == disk["peer_hit_tokens"] == 0
    assert ways["peer"]["failed"] == 0
    assert len(document["ratios"]) == 3 and set(document["goodput_req_s"]) == set(ways)
