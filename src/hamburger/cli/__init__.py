"""`hamburger` command line: a thin layer over the library, one module per group of commands.

Each module's `register(sub)` adds its subcommands with `set_defaults(func=cmd_...)`; the `cmd_*` functions import
the library when they run, so that `hamburger --help` and a mistyped option answer at once.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys

from hamburger.cli import demo, generate, measure, serve, train, vllm
from hamburger.errors import HamburgerError

GROUPS = (generate, train, measure, demo, serve, vllm)


class Parser(argparse.ArgumentParser):
    """An unknown option is reported by its subcommand, with a hint: the closest option it has (`--max-tokens` ->
    `--max-new-tokens`)."""

    def parse_args(self, args=None, namespace=None) -> argparse.Namespace:
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            commands = next(a for a in self._actions if isinstance(a, argparse._SubParsersAction)).choices
            command = commands[parsed.command]
            known = [o for o in command._option_string_actions if o.startswith("--")]
            hints = [close[0] for arg in extra if arg.startswith("--")
                     for close in [difflib.get_close_matches(arg.partition("=")[0], known, n=1)] if close]
            command.error(f"unrecognized arguments: {' '.join(extra)}"
                          + (f" (did you mean {hints[0]}?)" if hints else ""))
        return parsed


class Version(argparse.Action):
    """--version: the installed package's version, looked up only when asked (it costs a scan of the installed
    distributions)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        from importlib.metadata import version

        print(f"hamburger {version('hamburger')}")
        parser.exit()


def build_parser() -> Parser:
    parser = Parser(prog="hamburger", description="HAMburger: several tokens per base forward, one KV entry per step.")
    parser.add_argument("--version", action=Version, help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=argparse.ArgumentParser)
    for group in GROUPS:
        group.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except HamburgerError as exc:
        print(f"hamburger: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
