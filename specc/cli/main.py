"""`specc`'s entry point: parse, run the subcommand, and turn user errors into one line and exit code 2."""
from __future__ import annotations

import argparse
import sys

from ..errors import SpeccError, escape_control
from . import bundle_cmds, model_cmds, report_cmds, run_cmds
from .parser import SpeccParser


def build_parser() -> SpeccParser:
    """The parser of every subcommand."""
    parser = SpeccParser(prog="specc", description="Compile and run speculative decoding.")
    parser.add_argument("--version", action="version", version=f"specc {__import__('specc').__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=SpeccParser)
    bundle_cmds.add_compile_parser(sub)
    run_cmds.add_parsers(sub)
    bundle_cmds.add_parsers(sub)
    model_cmds.add_parsers(sub)
    report_cmds.add_parsers(sub)
    return parser


def _subparser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> SpeccParser:
    """The innermost subcommand's parser (`models list` -> the list parser)."""
    while True:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        name = sub and getattr(args, sub.dest, None)
        if name is None:
            return parser
        parser = sub.choices[name]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse argv; a wrong invocation exits 2 after the subcommand's usage and one `specc: error:` line."""
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        _subparser(parser, args).unknown(extras)
    return args


def main(argv: list[str] | None = None) -> int:
    """Run `specc ARGV`; returns the exit code (a wrong invocation exits 2 from the parser)."""
    args = parse(argv)
    from .format import terminal_safe

    try:
        return args.func(args)
    except SpeccError as exc:
        print(f"specc: error: {terminal_safe(str(exc))}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # stdout closed early (`| head`): nothing left to say
        sys.stderr.close()
        return 0
    except OSError as exc:  # a path the user gave that cannot be read or written
        where = f"{escape_control(exc.filename)}: " if exc.filename else ""
        print(f"specc: error: {terminal_safe(f'{where}{exc.strerror or exc}')}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specc: interrupted", file=sys.stderr)
        return 130


__all__ = ["build_parser", "main"]
