"""The settings under which a worker runs both roles' KV sides on one engine (SwitchableWorker:
`--role-switching` moves it between roles, `--hybrid` serves both at once), checked as
ServeConfig is made so that a bad combination fails at start with its reason."""

from __future__ import annotations

from typing import Any

from pdserve.config_fields import ConfigError


def check_switchable_workers(config: Any) -> None:
    """`config`: a ServeConfig (not imported: pdserve/config.py imports this module)."""
    router = config.router
    if not (router.role_switching or router.hybrid):
        return
    if router.role_switching and router.hybrid:
        raise ConfigError(
            "RouterConfig", "hybrid", "and --role-switching are not supported together"
        )
    flag = "role_switching" if router.role_switching else "hybrid"
    if router.role_switching:
        # A worker that changes role keeps its engine: both pools must run the same one.
        kinds = (
            config.prefill_engine or config.engine.kind,
            config.decode_engine or config.engine.kind,
        )
        if kinds[0] != kinds[1] or config.prefill_tp != config.decode_tp:
            raise ConfigError(
                "RouterConfig",
                flag,
                "needs the same engine and TP in both pools (--prefill-engine/--decode-engine, "
                "--prefill-tp/--decode-tp)",
            )
    # The collective and nixl transports pair fixed senders with receivers.
    if config.kv.transport != "grpc":
        raise ConfigError("RouterConfig", flag, "needs --kv-transport grpc")
    if config.engine.speculative.enabled:
        # A prefill worker loads no draft model, a decode worker does (pools.py); a hybrid one
        # would run prefill-only requests beside a draft.
        raise ConfigError("RouterConfig", flag, "is not supported with speculative decoding")
    if router.hybrid and config.decode_tp > 1:
        raise ConfigError(
            "RouterConfig",
            flag,
            "is not supported yet with --decode-tp > 1 (each rank has one KV side)",
        )
