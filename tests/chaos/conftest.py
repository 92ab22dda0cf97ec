"""What every chaos test shares: a random stream of its own for its victims and prompts."""

from __future__ import annotations

import random

import pytest

from tests.chaos.test_chaos import SEED


@pytest.fixture()
def rng(request) -> random.Random:
    # One stream per test, so a test's victims do not depend on which tests ran before it.
    return random.Random(f"{SEED}-{request.node.name}")
