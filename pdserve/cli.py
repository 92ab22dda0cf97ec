"""The `pdserve` command line. Each subcommand lives in its own module, imported only when run.

A command module exposes `add_arguments(parser)` (cheap: no torch or Ray imports at module level)
and `run(args) -> int` (the exit code), or a SUBCOMMANDS table of such modules. Only the chosen command's module is imported, so
`pdserve generate` starts fast and one command's dependencies never break another.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NoReturn

from pdserve.commands import CommandError

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("pdserve.commands.serve", "start Ray pools, the router and the gRPC API"),
    "generate": ("pdserve.commands.generate", "send one prompt to a running server"),
    "make-model": ("pdserve.commands.make_model", "write a random-weight HF model directory"),
    "stats": ("pdserve.commands.stats", "print prefix-cache reuse statistics from Redis"),
    "bench": (
        "pdserve.commands.bench",
        "benchmarks by what they measure: engine, serving, simulation...",
    ),
    "plan": ("pdserve.commands.plan", "how many prefill and decode workers, predicted offline"),
    "selftest": ("pdserve.commands.selftest", "parity, KV transfer and decode speed on a device"),
}


def add_lazy_subcommands(
    parser: argparse.ArgumentParser,
    table: dict[str, tuple[str, str]],
    argv: list[str],
    depth: int = 0,
    grouped: bool = False,
) -> None:
    """One subparser per entry; only the entry named in argv is imported and asked for its
    arguments (the others still show up, with their help line, in --help). A module with a
    SUBCOMMANDS table (like `bench`) gets its own level of lazy subcommands; one that also has
    GROUPS lists them in --help group by group instead of in one list."""
    listed = not grouped
    sub = parser.add_subparsers(
        dest=f"command{depth}",
        required=True,
        metavar="COMMAND",
        help=None if listed else "one of the commands below",
    )
    words = [a for a in argv if not a.startswith("-")]
    chosen = words[0] if words else None
    for name, (module_name, help_text) in table.items():
        # argparse lists a subcommand in --help only when it is given a help text.
        shown = {"help": help_text} if listed else {}
        command_parser = sub.add_parser(name, description=help_text, **shown)
        if name != chosen:
            continue
        parser.set_defaults(**{_CHOSEN: command_parser})  # read by OneLineErrorParser.error
        module = importlib.import_module(module_name)
        if hasattr(module, "SUBCOMMANDS"):
            groups = getattr(module, "GROUPS", None)
            if groups:
                command_parser.formatter_class = argparse.RawDescriptionHelpFormatter
                command_parser.epilog = grouped_listing(groups)
            add_lazy_subcommands(
                command_parser,
                module.SUBCOMMANDS,
                argv[argv.index(name) + 1 :],
                depth + 1,
                grouped=bool(groups),
            )
        else:
            module.add_arguments(command_parser)
            command_parser.set_defaults(_run=module.run)


def grouped_listing(groups: dict[str, dict[str, tuple[str, str]]]) -> str:
    """The subcommands of each group under its title, as --help shows a command list."""
    width = max(len(name) for group in groups.values() for name in group) + 2
    lines = []
    for title, group in groups.items():
        lines.append(f"{title}:")
        lines += [f"  {name:<{width}}{help_text}" for name, (_, help_text) in group.items()]
        lines.append("")
    return "\n".join(lines).rstrip()


_CHOSEN = "_chosen_parser"  # a parser's default: the subcommand parser argv chose


class OneLineErrorParser(argparse.ArgumentParser):
    """Usage errors as one line on stderr (exit code 2); the usage is one --help away. Flags
    argparse does not know are reported by the top parser: the error names the subcommand
    they were given to, and that subcommand's --help."""

    def error(self, message: str) -> NoReturn:
        parser: argparse.ArgumentParser = self
        while parser.get_default(_CHOSEN) is not None:
            parser = parser.get_default(_CHOSEN)
        self.exit(2, f"{parser.prog}: error: {message} (see {parser.prog} --help)\n")


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="pdserve", description=__doc__.splitlines()[0])
    add_lazy_subcommands(parser, COMMANDS, argv)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except CommandError as e:
        print(f"pdserve {args.command0}: error: {e}", file=sys.stderr, flush=True)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
