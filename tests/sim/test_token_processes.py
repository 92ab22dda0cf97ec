"""sim_token is the same function in every process: the live sim workers (separate processes,
each with its own PYTHONHASHSEED) and the planner must produce the same tokens for the same
context, greedy or seeded; and its log-probabilities lie in (-10, 0] and vary."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pdserve.sim.tokens import TokenSpace, sim_token

AVOID = [0, 1, 128000, 128001]  # special ids at both ends of a Llama-sized vocabulary
CASES = [
    ([5], None),
    ([5, 6, 7], None),
    (list(range(100, 140)), None),
    ([2**40, 3, 9], None),
    ([5, 6, 7], (0, 0)),
    ([5, 6, 7], (0, 1)),
    ([5, 6, 7], (2**63 - 1, 17)),  # a random seed is up to 63 bits (SimExecutor._salt)
    ([5, 6, 7], (2**64 - 1, 17)),  # a user's seed: up to 64 bits
]

_CHILD = """
import json, sys
from pdserve.sim.tokens import TokenSpace, sim_token
space = TokenSpace(128256, set(json.loads(sys.argv[1])))
cases = json.loads(sys.argv[2])
print(json.dumps([sim_token(c, space, tuple(s) if s else None) for c, s in cases]))
"""


def _in_process() -> list[list]:
    space = TokenSpace(128256, set(AVOID))
    return [list(sim_token(context, space, salt)) for context, salt in CASES]


@pytest.mark.parametrize("hash_seed", ["0", "1", "random"])
def test_other_processes_make_the_same_tokens(hash_seed):
    env = dict(os.environ, PYTHONHASHSEED=hash_seed)
    child = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(AVOID), json.dumps(CASES)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(child.stdout) == _in_process()


def test_tokens_depend_on_context_and_salt_and_avoid_special_ids():
    space = TokenSpace(128256, set(AVOID))
    results = _in_process()
    assert len({token for token, _ in results}) == len(CASES)  # all differ here
    long_context = [sim_token(list(range(n)), space) for n in range(1, 2000)]
    assert not {t for t, _ in long_context} & set(AVOID)
    logprobs = [lp for _, lp in long_context]
    assert all(-10 < lp <= 0 for lp in logprobs)
    assert len(set(logprobs)) > 1500  # values spread over the range, not a few
