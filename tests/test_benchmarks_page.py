"""BENCHMARKS.md stays the page a user reads: short, every command on it still parses with
today's CLI (a renamed or removed flag fails here, not in a user's terminal), and every area's
history page it links exists."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from pdserve.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "BENCHMARKS.md"
HISTORY = ROOT / "docs" / "benchmarks"
AREAS = (
    "engine",
    "decoding",
    "speculation",
    "transfer",
    "serving",
    "routing",
    "simulation",
    "planner",
)


def page_commands() -> list[str]:
    """The command column of every table on the page, in order."""
    return re.findall(r"\| `(pdserve [^`]+)` \|", PAGE.read_text())


def parse_error(command: str) -> str | None:
    """What the CLI's own argument parser says of the command, None when it accepts it. Only the
    arguments are parsed: no benchmark runs."""
    argv = shlex.split(command)[1:]
    try:
        build_parser(argv).parse_args(argv)
    except SystemExit as e:  # --help exits 0
        return None if e.code == 0 else f"exit {e.code}"
    return None


def test_the_page_is_short():
    assert len(PAGE.read_text().splitlines()) <= 250


def test_the_page_names_commands_of_every_group_of_bench():
    named = {shlex.split(c)[2] for c in page_commands() if c.startswith("pdserve bench ")}
    assert {"engine", "spec", "transfer", "api", "control-plane", "plan-validate"} <= named


@pytest.mark.parametrize("command", page_commands())
def test_every_command_on_the_page_parses(command, capsys):
    error = parse_error(command)
    assert error is None, f"{command!r}: {error}: {capsys.readouterr().err.strip()}"


def test_a_renamed_flag_is_caught(capsys):
    assert parse_error("pdserve bench engine --preset small --batchsizes 32") == "exit 2"
    assert "--batchsizes" in capsys.readouterr().err


def test_every_area_has_a_table_linking_its_history_page():
    text = PAGE.read_text()
    for area in AREAS:
        assert f"](docs/benchmarks/{area}.md)" in text, area


def test_every_link_of_the_page_and_the_history_pages_exists():
    pages = [PAGE, *sorted(HISTORY.glob("*.md"))]
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.name} links {target}"
