"""Every registered command and benchmark exists, parses its flags, and starts without torch."""

from __future__ import annotations

import json
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
