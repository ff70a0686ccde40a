"""What a compiled grammar is known by and how it compiles: shared by `Grammars` (runtime/grammar.py) and the
server's grammar worker (serving/grammar_worker.py), which must compile a key alike."""
from __future__ import annotations

JSON_OBJECT = "json_object"  # Rules.json_schema for any JSON object (response_format json_object)
TAG_KEY = "structural_tag:"  # the cache key of a structural tag: this, then the tag (a schema is JSON text)
MAX_GRAMMAR_BYTES = 128 << 20  # a compiled grammar's memory (checked where a GrammarChecker compiles first)


class GrammarChecker:
    """What `Grammars.use_checker` takes: compiles and checks a schema or tag (its cache key) elsewhere."""

    def check(self, key: str) -> str | None:
        """Why the schema or tag (a `Grammars` cache key) cannot be used (a RequestError's message), or None."""
        raise NotImplementedError

    def wait_ready(self) -> None:
        """Wait until a check can start (a caller's compile time limit starts after it)."""


UNSATISFIABLE = ("json_schema admits no output the model can write: every way to start it leads to a place where only "
                 "raw control characters (or nothing) may follow, and compact JSON allows none (a pattern that needs a "
                 "tab or newline inside a string is one)")
HINTS = {"json_schema": "(fewer or shorter enum values, patterns with smaller repetition counts)",
         "structural_tag": "(fewer tools, or simpler parameters)"}


def too_slow(what: str, seconds: float) -> str:
    """The message of a schema ("json_schema") or tag ("structural_tag") that did not compile in `seconds`."""
    return f"{what} took longer than {seconds:g} s to compile; simplify it {HINTS[what]}"


def compile_key(compiler, key: str):
    """The compiled grammar of a `Grammars` cache key: JSON_OBJECT, a schema's text, or TAG_KEY + a tag."""
    if key.startswith(TAG_KEY):
        # no satisfiability search: a tag has no printable mask (TagMatcher), so the control-character dead end
        # it looks for cannot arise; a dead end reached anyway still fails only its own row (RowRule.commit)
        return compiler.compile_structural_tag(key[len(TAG_KEY):])
    # compact JSON (no free whitespace): a model cannot stall in endless spaces
    text = '{"type": "object"}' if key == JSON_OBJECT else key
    return compiler.compile_json_schema(text, any_whitespace=False, separators=(",", ":"),
                                        strict_mode=key != JSON_OBJECT)
