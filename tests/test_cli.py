"""Every registered command and benchmark exists, parses its flags, and starts without torch."""

from __future__ import annotations

import subprocess
import sys

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


def test_client_side_commands_do_not_import_torch_or_ray():
    # `pdserve generate` and `pdserve stats` run on laptops and in probes: they must start fast.
    code = (
        "import sys; from pdserve.cli import build_parser; "
        "build_parser(['generate']); build_parser(['stats']); build_parser(['serve']); "
        "import router.app, router.generation_service; "
        "print(sorted(m for m in ('torch', 'ray') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
