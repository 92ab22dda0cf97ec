"""Settings are defined once (pdserve/config.py, pdserve/engine_config.py): the `pdserve serve`
flags, their defaults and their checks all come from the dataclass fields."""

from __future__ import annotations

import argparse
import dataclasses
import typing

import pytest

from pdserve.commands import CommandError
from pdserve.commands.config_args import add_config_arguments, config_from_args, flag_of
from pdserve.commands.serve import add_arguments, serve_config
from pdserve.config import (
    ConfigError,
    KVTransferConfig,
    LogConfig,
    RouterConfig,
    ServeConfig,
    WorkerConfig,
)
from pdserve.config_fields import MiB
from pdserve.engine_config import EngineConfig, SimConfig, SpeculativeConfig

SETTINGS = (
    EngineConfig,
    SimConfig,
    SpeculativeConfig,
    KVTransferConfig,
    RouterConfig,
    WorkerConfig,
    LogConfig,
    ServeConfig,
)


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve serve")
    add_arguments(parser)
    return parser


def parse(*argv: str) -> ServeConfig:
    return serve_config(serve_parser().parse_args(list(argv)))


def cli_fields():
    for cls in SETTINGS:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if not dataclasses.is_dataclass(hints[f.name]):
                yield cls, f


def test_no_flags_give_the_dataclass_defaults(monkeypatch):
    monkeypatch.delenv("PDSERVE_REDIS_URL", raising=False)
    assert parse() == ServeConfig()


def test_every_setting_has_help_and_a_flag_or_a_reason_not_to():
    flags = [flag_of(f) for _, f in cli_fields() if f.metadata["cli"]]
    assert len(flags) == len(set(flags)), "two settings share a flag"
    for cls, f in cli_fields():
        assert f.metadata, f"{cls.__name__}.{f.name} is not made with setting()"
        if f.metadata["cli"] and not f.metadata["choices"]:
            assert f.metadata["help"], f"{cls.__name__}.{f.name} has no help text"


def test_help_shows_the_defaults():
    text = serve_parser().format_help()
    for expected in ("tokens per KV block (default: 16)", "(default: 50051)", "(default: 256)"):
        assert expected in " ".join(text.split())


def test_flags_reach_every_config_with_units_and_negations():
    config = parse(
        "--port", "0", "--kv-port", "7000", "--kv-cache-mb", "3", "--no-prefix-caching",
        "--worker-metrics-port", "0", "--prefix-heartbeat-ttl-s", "1.5", "--fault-injection",
        "--log-level", "DEBUG", "--log-format", "json", "--policy", "least_loaded",
        "--decode-workers", "3", "--kv-transport", "collective",
    )  # fmt: skip
    assert (config.router.port, config.kv.port) == (0, 7000)
    assert config.engine.kv_cache_bytes == 3 * MiB
    assert config.engine.enable_prefix_caching is False
    assert config.worker == WorkerConfig(
        metrics_port=0, prefix_heartbeat_ttl_s=1.5, fault_injection=True
    )
    assert config.log == LogConfig(format="json", level="DEBUG")
    assert (config.router.policy, config.decode_workers, config.kv.transport) == (
        "least_loaded", 3, "collective"
    )  # fmt: skip


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--block-size", "0"], "--block-size: must be at least 1, got 0"),
        (["--port", "70000"], "--port: must be at most 65535, got 70000"),
        (["--prefix-heartbeat-ttl-s", "0"], "--prefix-heartbeat-ttl-s: must be more than 0"),
        (["--device", "gpu"], "--device: must be cpu, cuda or cuda:N, got 'gpu'"),
        (["--decode-workers", "0"], "--decode-workers: must be at least 1, got 0"),
        (["--max-retries", "-1"], "--max-retries: must be at least 0, got -1"),
        (["--kv-offload-gb", "-1"], "--kv-offload-gb: must be at least 0, got -1.0"),
        (
            ["--kv-offload-gb", "4", "--kv-disk-dir", "/tmp/kv", "--kv-disk-gb", "8"]
            + ["--prefill-tp", "2"],
            "--prefill-tp: --kv-disk-gb is not supported yet under TP",
        ),
        (["--kv-offload-gb", "1", "--kv-disk-gb", "2"], "--kv-disk-gb: needs --kv-disk-dir DIR"),
        (
            ["--kv-disk-dir", "/tmp/kv", "--kv-disk-gb", "2"],
            "--kv-disk-gb: needs --kv-offload-gb (the host tier)",
        ),
    ],
)
def test_bad_values_name_their_flag(argv, message):
    with pytest.raises(CommandError) as error:
        parse(*argv)
    assert str(error.value).startswith(message)


def test_tp_flags_give_each_pool_its_engine_tp():
    config = parse("--prefill-tp", "2", "--decode-tp", "4")
    assert (config.engine_for("prefill").tp, config.engine_for("decode").tp) == (2, 4)
    assert config.engine.tp == 1  # the shared engine settings are untouched
    default = parse()
    assert default.engine_for("decode") is default.engine  # TP 1: the one engine config
    with pytest.raises(CommandError, match="^--decode-tp: must be at least 1, got 0"):
        parse("--decode-tp", "0")
    with pytest.raises(CommandError, match="simulated workers model tensor parallelism"):
        parse("--engine", "sim", "--prefill-tp", "2")
    nixl = parse("--kv-transport", "nixl", "--prefill-tp", "4", "--decode-tp", "2")
    assert (nixl.prefill_tp, nixl.decode_tp) == (4, 2)  # each rank reads its own heads


def test_expert_parallel_reaches_the_tp_pools_only_and_needs_one():
    config = parse("--expert-parallel", "--decode-tp", "2")
    assert config.engine_for("decode").expert_parallel
    assert not config.engine_for("prefill").expert_parallel  # TP 1: nothing to spread
    assert not parse("--decode-tp", "2").engine_for("decode").expert_parallel  # the default
    with pytest.raises(CommandError) as error:
        parse("--expert-parallel")
    assert str(error.value).startswith(
        "--expert-parallel: needs --prefill-tp or --decode-tp above 1 (both are 1)"
    )


def test_the_dataclasses_check_values_set_in_code():
    with pytest.raises(ConfigError, match=r"^EngineConfig\.block_size: must be at least 1"):
        EngineConfig(block_size=0)
    with pytest.raises(ConfigError, match=r"^RouterConfig\.policy: must be one of cost"):
        RouterConfig(policy="lottery")
    assert LogConfig(level="debug").level == "DEBUG"


def test_a_nested_group_per_dataclass():
    parser = argparse.ArgumentParser()
    groups = add_config_arguments(parser, ServeConfig)
    assert set(groups) == set(SETTINGS)
    assert config_from_args(ServeConfig, parser.parse_args([])) == ServeConfig()


def test_secrets_come_from_files_or_the_environment(tmp_path, monkeypatch):
    url_file, secret_file = tmp_path / "redis-url", tmp_path / "kv-secret"
    url_file.write_text("redis://:pw@db:6379/0\n")
    secret_file.write_text("  s3cret\n")
    monkeypatch.setenv("PDSERVE_REDIS_URL", "redis://env:6379/0")
    assert parse().redis_url == "redis://env:6379/0"
    assert parse("--redis-url", "redis://flag:6379/0").redis_url == "redis://flag:6379/0"
    config = parse("--redis-url-file", str(url_file), "--kv-secret-file", str(secret_file))
    assert (config.redis_url, config.kv.secret) == ("redis://:pw@db:6379/0", "s3cret")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--kv-secret-file", "{tmp}/absent"], "--kv-secret-file: cannot read .*absent"),
        (["--kv-secret-file", "{tmp}/empty"], "--kv-secret-file: .*empty is empty"),
        (["--redis-url", "redis://a", "--redis-url-file", "{tmp}/empty"], "give one of them"),
    ],
)
def test_unusable_secret_inputs_are_one_line_errors(argv, message, tmp_path):
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(CommandError, match=message):
        parse(*(a.format(tmp=tmp_path) for a in argv))


def test_sim_workers_take_kv_tiers_without_a_directory():
    # A sim worker's tiers hold no bytes (pdserve/sim/kv_tiers.py): the disk tier writes no files.
    config = parse("--engine", "sim", "--kv-offload-gb", "4", "--kv-disk-gb", "8")
    assert (config.engine.kv_offload_gb, config.engine.kv_disk_gb) == (4.0, 8.0)
    assert config.engine.kv_disk_dir is None
    with pytest.raises(CommandError, match="--kv-disk-gb: needs --kv-disk-dir DIR"):
        parse("--kv-offload-gb", "4", "--kv-disk-gb", "8")  # the torch engine's does
