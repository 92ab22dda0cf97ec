"""The planner runs in one plain process: importing it loads none of Ray, gRPC, Redis, torch
(lint-imports checks the static imports; this checks what Python actually loads)."""

from __future__ import annotations

import subprocess
import sys


def test_the_planner_loads_no_ray_grpc_redis_or_torch():
    code = (
        "import sys\n"
        "import pdserve.planner.search, pdserve.planner.report, pdserve.commands.plan\n"
        "print(sorted(m for m in ('ray', 'grpc', 'redis', 'torch') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"
