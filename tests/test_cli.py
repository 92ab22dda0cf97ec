"""Every registered command and benchmark exists, parses its flags, and starts without torch."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from concurrent import futures

import grpc
import pytest

from pdserve.cli import COMMANDS, build_parser
from pdserve.commands.bench import SUBCOMMANDS as BENCHMARKS

COMMAND_LINES = [[name] for name in COMMANDS if name != "bench"]
COMMAND_LINES += [["bench", name] for name in BENCHMARKS]


@pytest.mark.parametrize("words", COMMAND_LINES, ids=" ".join)
def test_every_command_builds_its_parser(words, capsys):
    parser = build_parser(words)
    with pytest.raises(SystemExit) as done:
        parser.parse_args([*words, "--help"])
    assert done.value.code == 0
    assert "usage: pdserve" in capsys.readouterr().out


def imported_after(code: str) -> list[str]:
    """Which of torch and ray a fresh interpreter has imported after running `code`."""
    probe = (
        f"import json, sys; {code}; "
        "print(json.dumps(sorted(m for m in ('torch', 'ray') if m in sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_client_side_commands_import_neither_torch_nor_ray():
    # `pdserve generate` and `pdserve stats` run on laptops and in probes: they must start fast.
    code = (
        "from pdserve.cli import build_parser; build_parser(['generate']); build_parser(['stats'])"
    )
    assert imported_after(code) == []


def test_the_router_process_never_imports_torch():
    code = (
        "import pdserve.app, pdserve.worker.pools, router.routing, router.generation_service; "
        "from pdserve.models.builtin import default_model_dir; default_model_dir()"
    )
    assert "torch" not in imported_after(code)


# ---- start-up mistakes: a one-line error within seconds, before Ray or any worker starts ----
FAST_S = 20.0  # a mistake found at start-up; before, they took 30 s or hung


def run_pdserve(
    *argv: str, timeout: float = 60.0, env: dict[str, str] | None = None
) -> tuple[int, list[str], float]:
    """Exit code, stderr lines without log lines, seconds taken; `env` adds to the
    environment."""
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PDSERVE_REDIS_URL": "", **(env or {})},
    )
    lines = [line for line in done.stderr.splitlines() if " INFO " not in line]
    return done.returncode, lines, time.monotonic() - started


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from pdserve.models.builtin import make_model

    return make_model(tmp_path_factory.mktemp("tiny"), "tiny", seed=0)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_busy_port_is_refused_before_anything_starts(model_dir):
    # A gRPC server sets SO_REUSEPORT: pdserve must not silently share its port.
    squatter = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    port = squatter.add_insecure_port("127.0.0.1:0")
    squatter.start()
    try:
        code, lines, seconds = run_pdserve(
            "serve", "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port)
        )
    finally:
        squatter.stop(None)
    assert code == 1
    assert lines == [
        f"pdserve serve: error: port {port} (--port) is in use; pick another with --port or 0 "
        "for any free port"
    ]
    assert seconds < FAST_S


def test_a_missing_model_is_reported_before_ray_starts(tmp_path):
    code, lines, seconds = run_pdserve("serve", "--model", str(tmp_path / "absent"), "--port", "0")
    assert code == 1
    assert lines == [f"pdserve serve: error: --model: directory {tmp_path}/absent does not exist"]
    assert seconds < FAST_S


def test_an_unreachable_ray_address_fails_fast(model_dir):
    address = f"127.0.0.1:{free_port()}"
    code, lines, seconds = run_pdserve(
        "serve",
        "--model",
        str(model_dir),
        "--port",
        "0",
        "--http-port",
        "0",
        "--ray-address",
        address,
    )
    assert code == 1
    assert lines == [
        f"pdserve serve: error: --ray-address {address}: cannot connect: Connection refused"
    ]
    assert seconds < FAST_S


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "hi", "--max-tokens", "-1"], "argument --max-tokens: must be at least 1"),
        (["generate", "hi", "--seed", "-1"], "argument --seed: must be at least 0"),
        (["generate", "hi", "--top-p", "1.5"], "argument --top-p: must be at most 1"),
        (["serve", "--block-size", "0"], "--block-size: must be at least 1, got 0"),
        (["serve", "--kv-secret-file", "/nonexistent"], "--kv-secret-file: cannot read"),
    ],
)
def test_bad_flags_are_one_line_usage_errors(argv, message):
    code, lines, seconds = run_pdserve(*argv)
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith(f"pdserve {argv[0]}: error: {message}")
    assert seconds < FAST_S


def test_a_file_given_as_model_is_named_a_file(model_dir):
    weights = model_dir / "config.json"
    code, lines, seconds = run_pdserve("serve", "--model", str(weights), "--port", "0")
    assert code == 1
    assert lines == [
        f"pdserve serve: error: --model: {weights} is a file; --model takes a Hugging Face "
        "model directory"
    ]
    assert seconds < FAST_S


@pytest.mark.parametrize(
    "argv",
    [["serve", "--no-such-flag"], ["generate", "hi", "--port", "1"], ["bench", "engine", "--nope"]],
)
def test_an_unknown_flag_points_at_its_subcommands_help(argv):
    code, lines, _ = run_pdserve(*argv)
    command = "pdserve " + " ".join(w for w in argv[:2] if not w.startswith("-") and w != "hi")
    assert code == 2 and len(lines) == 1
    assert lines[0].startswith(f"{command}: error: unrecognized arguments: ")
    assert lines[0].endswith(f"(see {command} --help)")


@pytest.mark.parametrize("command", [["generate", "hi"], ["stats"]])
def test_client_commands_take_the_router_as_target(command, capsys):
    parser = build_parser(command)
    with pytest.raises(SystemExit):
        parser.parse_args([*command, "--help"])
    help_text = capsys.readouterr().out
    assert "--target HOST:PORT" in help_text and "--port" not in help_text


def test_generate_without_a_server_is_one_clear_line():
    target = f"127.0.0.1:{free_port()}"
    code, lines, seconds = run_pdserve("generate", "hi", "--target", target, "--timeout", "5")
    assert code == 1
    assert lines == [
        f"error: no pdserve server at {target}: is `pdserve serve` running? (--target)"
    ]
    assert seconds < FAST_S


def test_colocated_mode_is_in_serves_help(capsys):
    parser = build_parser(["serve"])
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--help"])
    assert "0 = colocated" in " ".join(capsys.readouterr().out.split())
