"""`specc report`: benchmark results rendered into the Markdown that cites them (specc/bench/results.py)."""
from __future__ import annotations

import argparse
from pathlib import Path


def cmd_report(args: argparse.Namespace) -> int:
    from ..bench.results import report

    return report(args.results, write=args.write or [], check=args.check or [])


def add_parsers(sub) -> None:
    """`specc report`."""
    p = sub.add_parser("report", help="render benchmark results (docs/results/*.json) into the Markdown that cites them",
                       description="Print each results file's table, or fill the results regions of Markdown files "
                                   "(--write), or check that they agree (--check: exit code 2 if not). "
                                   "Regenerate the docs: specc report docs/results/*.json --write README.md docs/*.md")
    p.add_argument("results", nargs="+", type=Path,
                   help="results files (`specc bench --json` output, or docs/results/*.json)")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--write", nargs="+", type=Path, metavar="MD",
                     help="re-render the regions of these Markdown files in place (default: print every table)")
    out.add_argument("--check", nargs="+", type=Path, metavar="MD",
                     help="exit with code 2 if any region of these Markdown files disagrees with what it is rendered from")
    p.set_defaults(func=cmd_report)
