"""Issue 14 point 6: sim workers on a multi-node Ray cluster formed on this machine (a head
without pool resources, a prefill node, a decode node) serve through the real router, each
actor on the node of its pool, with the in-process sim engine's tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import REPO_ROOT


def test_pools_on_their_own_nodes_serve_the_sim_tokens(sim_model_dir):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    # Its own process: Ray allows one cluster per process and this session has one.
    done = subprocess.run(
        [sys.executable, "-m", "tests.sim.multinode_serve", str(sim_model_dir)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["tokens"] == result["expected"]
    assert all(len(t) > 0 for t in result["tokens"])
    nodes = result["node_ids"]
    assert all(isinstance(n, str) and n for n in nodes.values())
    assert len(set(nodes.values())) == 3
    assert result["actor_nodes"] == {"prefill-0": nodes["prefill"], "decode-0": nodes["decode"]}
    # The handoffs crossed nodes through the grpc KV transport.
    assert result["transfer_bytes"] > 0
