"""The `pdserve` command line. Each subcommand lives in its own module, imported only when run.

A command module exposes `add_arguments(parser)` (cheap: no torch or Ray imports at module level)
and `run(args) -> int` (the exit code).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("pdserve.commands.serve", "start Ray pools, the router and the gRPC API"),
    "generate": ("pdserve.commands.generate", "send one prompt to a running server"),
    "make-model": ("pdserve.commands.make_model", "write a random-weight HF model directory"),
    "stats": ("pdserve.commands.stats", "print prefix-cache reuse statistics from Redis"),
    "bench": ("pdserve.commands.bench", "benchmarks: engine, transfer, serve, compare, router"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        module = importlib.import_module(module_name)
        module.add_arguments(command_parser)
        command_parser.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
