"""`--hybrid`: the settings a hybrid worker (SwitchableWorker in both roles) cannot run with
are refused at start, each with its reason."""

from __future__ import annotations

import pytest

from pdserve.config import KVTransferConfig, RouterConfig, ServeConfig
from pdserve.config_fields import ConfigError
from pdserve.engine_config import EngineConfig, SpeculativeConfig


def hybrid(**changes) -> ServeConfig:
    return ServeConfig(router=RouterConfig(hybrid=True), prefill_workers=0, **changes)


def test_hybrid_workers_start_with_the_grpc_transport():
    assert hybrid().router.hybrid


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"kv": KVTransferConfig(transport="collective")}, "needs --kv-transport grpc"),
        (
            {"router": RouterConfig(hybrid=True, role_switching=True, plan_interval_s=5.0)},
            "--role-switching are not supported together",
        ),
        (
            {"engine": EngineConfig(speculative=SpeculativeConfig(method="ngram"))},
            "speculative decoding",
        ),
        ({"decode_tp": 2}, "--decode-tp > 1"),
    ],
)
def test_what_hybrid_workers_cannot_run_with_is_refused(changes, message):
    changes.setdefault("router", RouterConfig(hybrid=True))
    with pytest.raises(ConfigError, match=f"hybrid: .*{message}"):
        ServeConfig(prefill_workers=0, **changes)
