"""The argument parser every subcommand shares: defaults in `--help`, one `specc: error:` line (exit 2)
with the subcommand's usage and a "did you mean" suggestion, and the flags several subcommands take."""
from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import NoReturn

# `--json` without a FILE: the JSON goes to stdout
JSON_STDOUT = "-"


class HelpFormatter(argparse.HelpFormatter):
    """An option's default appended to its help where it has one (not None or False) and the help does
    not already say what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if not action.option_strings or default in (None, False, argparse.SUPPRESS) or "default" in text:
            return text
        shown = "%(default)s" if not isinstance(default, (list, tuple)) else ", ".join(map(str, default))
        return f"{text} (default: {shown})"


class RawEpilogHelpFormatter(argparse.RawDescriptionHelpFormatter, HelpFormatter):
    """HelpFormatter keeping the description and epilog as written (compile's table of recipe fields)."""


def suggest(word: str, choices: Iterable[str]) -> str:
    """' (did you mean X?)' for the closest of choices, or ''."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


class SpeccParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors end in one `specc: error:` line after its own usage, and whose
    unknown options and invalid choices suggest the closest allowed spelling."""

    def __init__(self, *args, epilog_factory=None, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self._argv: list[str] = []
        self._epilog_factory = epilog_factory  # an epilog built only for --help (the recipe schema imports torch)

    def format_help(self) -> str:
        if self._epilog_factory is not None and self.epilog is None:
            self.epilog = self._epilog_factory()
        return super().format_help()

    def add_argument(self, *args, **kwargs):
        if kwargs.get("type") is int and "metavar" not in kwargs and args and args[0].startswith("-"):
            kwargs["metavar"] = "N"
        return super().add_argument(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def _check_value(self, action: argparse.Action, value) -> None:
        if action.choices is not None and value not in action.choices:
            allowed = ", ".join(map(str, action.choices))
            raise argparse.ArgumentError(action, f"invalid choice {value!r}{suggest(str(value), map(str, action.choices))}; "
                                                 f"allowed: {allowed}")

    def unknown(self, extras: list[str]) -> None:
        """Refuse arguments this subcommand does not take, naming the closest option it does."""
        options = [s for a in self._actions if a.help != argparse.SUPPRESS for s in a.option_strings]
        first = extras[0]
        hint = suggest(first.split("=", 1)[0], options) if first.startswith("-") else ""
        self.error(f"unrecognized argument{'s' if len(extras) > 1 else ''}: {' '.join(extras)}{hint}; "
                   f"`{self.prog} --help` lists the options")

    def error(self, message: str) -> NoReturn:
        if "the following arguments are required" in message and _json_took_a_positional(self._argv):
            message += "; --json takes an optional FILE, so write it after the positional arguments (or --json=-)"
        self.print_usage(sys.stderr)
        from .format import terminal_safe

        self.exit(2, f"specc: error: {terminal_safe(message)}\n")


def _json_took_a_positional(argv: list[str]) -> bool:
    """Whether `--json` was followed by a word that argparse took as its FILE."""
    return any(a == "--json" and i + 1 < len(argv) and not argv[i + 1].startswith("-") for i, a in enumerate(argv))


class _Deprecated(argparse.Action):
    """An old spelling of an option: warns, then acts as the new option."""

    def __init__(self, option_strings, dest, target: argparse.Action, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.target = target

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"specc: warning: {option_string} is deprecated; use {self.target.option_strings[-1]}", file=sys.stderr)
        self.target(parser, namespace, values, self.target.option_strings[-1])


def deprecated_alias(p: argparse.ArgumentParser, old: str, target: argparse.Action) -> None:
    """Accept `old` as a hidden spelling of `target` (not in --help)."""
    p.add_argument(old, action=_Deprecated, target=target, type=target.type, nargs=target.nargs,
                   dest=f"_deprecated_{old.strip('-').replace('-', '_')}", default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def k_value(text: str) -> int | str:
    """--k: an integer, or 'auto' (adaptive speculation)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer in [1, 16] or 'auto', got {text!r}") from None


def add_json(p: argparse.ArgumentParser, what: str) -> None:
    """`--json`: print `what` as JSON on stdout (other output goes to stderr); `--json FILE`: write it there."""
    p.add_argument("--json", nargs="?", const=JSON_STDOUT, metavar="FILE",
                   help=f"{what} as JSON: on stdout without FILE (everything else then goes to stderr), "
                        "else written to FILE")


def add_sampling(p: argparse.ArgumentParser) -> None:
    """--max-new-tokens, --temperature, --top-k, --top-p, --seed."""
    p.add_argument("--max-new-tokens", type=int, default=64, help="most tokens generated per prompt")
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: the recipe's)")
    p.add_argument("--top-k", type=int, default=None,
                   help="sample among the K most likely tokens only (default: the recipe's; 0: all)")
    p.add_argument("--top-p", type=float, default=None,
                   help="sample among the most likely tokens whose probabilities add up to P, in (0, 1] "
                        "(default: the recipe's)")
    add_seed(p)


def add_seed(p: argparse.ArgumentParser) -> None:
    """--seed."""
    p.add_argument("--seed", type=int, default=0, help="random seed of sampling (the same seed repeats a sampled run)")


def add_context_settings(p: argparse.ArgumentParser, prefix_cache_default: int | None = None) -> None:
    """--prefix-cache-mb and --prefill-chunk (runtime settings of long prompts)."""
    auto = "a tenth of the memory available at start, at most 4096"
    p.add_argument("--prefix-cache-mb", type=int, default=prefix_cache_default, metavar="MB",
                   help="memory for KV of prompt prefixes reused across requests and turns, evicted least recently "
                        f"used first; 0: off (default: {auto if prefix_cache_default is None else '%(default)s'})")
    p.add_argument("--prefill-chunk", type=int, default=256, metavar="TOKENS",
                   help="prompt tokens per prefill pass; a longer prompt prefills in chunks, between rounds of the "
                        "running batch")


def apply_context_settings(model, args: argparse.Namespace) -> None:
    """Set a loaded SpecModel's prefix cache and prefill chunk from --prefix-cache-mb and --prefill-chunk."""
    if args.prefix_cache_mb is not None:
        model.set_prefix_cache_mb(args.prefix_cache_mb)
    model.prefill_chunk = args.prefill_chunk


def add_verify(p: argparse.ArgumentParser) -> None:
    """--no-verify."""
    p.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the bundle's files "
                   "(sizes and the file listing are still checked)")


def add_prompts(p: argparse.ArgumentParser) -> None:
    """--prompt, --prompts FILE, --chat, and the bundle flags of commands that run prompts."""
    p.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    p.add_argument("--prompts", type=Path, metavar="FILE",
                   help="file: JSON lines {\"prompt\": ..., \"chat\": bool} or one prompt per line")
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template to plain prompts")
    add_verify(p)
    add_trust(p)


def add_warm(p: argparse.ArgumentParser) -> None:
    """--warm FILE: seed a suffix-decoding bundle's cache of earlier outputs."""
    p.add_argument("--warm", type=Path, metavar="FILE",
                   help="JSON lines of earlier outputs ({\"text\": ...} or {\"prompt\": ..., \"completion\": ...}) to "
                        "seed the suffix drafter's cache with (bundles with draft.method suffix or draft.suffix; "
                        "default: start empty)")


def add_trust(p: argparse.ArgumentParser) -> None:
    """--expect-id, --trust-code."""
    p.add_argument("--expect-id", metavar="ID", help="refuse the bundle unless its id (`specc inspect`) is ID")
    p.add_argument("--trust-code", action="store_true", help="allow backends that run code from the bundle "
                   "(aoti shared objects, torch_tensorrt pickles); see docs/security.md")


def json_file(args: argparse.Namespace) -> Path | None:
    """The file `--json FILE` names, or None (no --json, or --json to stdout)."""
    value = getattr(args, "json", None)
    return None if value in (None, JSON_STDOUT) else Path(value)


def json_to_stdout(args: argparse.Namespace) -> bool:
    """Whether `--json` was given without a FILE."""
    return getattr(args, "json", None) == JSON_STDOUT
