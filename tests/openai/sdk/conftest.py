"""One served system for every module of this package (the official `openai` SDK and the benches
against it), started once: the tiny model behind KEY, 1 prefill + 1 decode worker,
disaggregated. A package of its own, so that it is stopped before another module starts its
system (worker actors are named: two systems cannot share the Ray cluster)."""

from __future__ import annotations

import pytest

from pdserve.client import GenerationClient
from tests.openai.served import KEY, keyed_config, serve


@pytest.fixture(scope="package")
def served(ray_cluster, tmp_path_factory):
    with serve(keyed_config(tmp_path_factory)) as app:
        yield app


@pytest.fixture(scope="module")
def grpc_client(served):
    with GenerationClient(f"127.0.0.1:{served.port}", api_key=KEY) as client:
        yield client
