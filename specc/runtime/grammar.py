"""JSON grammars for structured output, with xgrammar (a matcher per request, rolled back after speculation).

xgrammar was chosen over llguidance because it installs as a wheel on this CPU, compiles a schema in
milliseconds, and its GrammarMatcher has `rollback`, which is what a verify pass needs: the matcher is
advanced over the drafts to mask each position, then rolled back to the committed output.
"""
from __future__ import annotations

import json
import re
import threading

from ..errors import RequestError

JSON_OBJECT = "json_object"  # Rules.json_schema for any JSON object (response_format json_object)


class Grammars:
    """Compiles JSON schemas against one model's tokenizer (cached by schema text) and makes matchers."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, sorted(eos_ids)
        self._compiler = None
        self._cache: dict[str, object] = {}
        self._lock = threading.Lock()

    def compiler(self):
        if self._compiler is None:
            try:
                import xgrammar as xgr
            except ImportError:
                raise RequestError("structured output needs the xgrammar package: pip install 'specc[serve]'") from None
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.eos_ids)
            self._compiler = xgr.GrammarCompiler(info)
            self._printable = printable_mask(info.decoded_vocab, self.vocab_size, self.eos_ids)
        return self._compiler

    def compile(self, schema: str):
        """The compiled grammar of a JSON schema (JSON text) or of JSON_OBJECT; RequestError naming what
        the library could not compile."""
        with self._lock:
            if schema not in self._cache:
                compiler = self.compiler()
                try:
                    if schema == JSON_OBJECT:
                        grammar = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                               separators=(",", ":"))
                    else:
                        # compact JSON (no free whitespace): a model cannot stall in endless spaces
                        grammar = compiler.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"),
                                                               strict_mode=True)
                except Exception as exc:  # xgrammar raises RuntimeError/ValueError with its own message
                    raise RequestError(f"json_schema could not be compiled: {_first_line(exc)}") from None
                self._cache[schema] = grammar
            return self._cache[schema]

    def compile_tag(self, tag: str):
        """The compiled grammar of an xgrammar structural tag (JSON text); RequestError naming what the library
        could not compile."""
        key = "structural_tag:" + tag
        with self._lock:
            if key not in self._cache:
                compiler = self.compiler()
                try:
                    self._cache[key] = compiler.compile_structural_tag(tag)
                except Exception as exc:  # xgrammar raises RuntimeError/ValueError with its own message
                    raise RequestError(f"structural_tag could not be compiled: {_first_line(exc)}") from None
            return self._cache[key]

    def matcher(self, schema: str) -> "CompactJsonMatcher":
        import xgrammar as xgr

        grammar = self.compile(schema)
        return CompactJsonMatcher(xgr.GrammarMatcher(grammar), self._printable)

    def tag_matcher(self, tag: str):
        """A matcher of a structural tag. No printable mask: the text around tool calls may hold newlines, and
        xgrammar's JSON strings inside the tags refuse raw control characters themselves."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile_tag(tag))


def schema_ebnf(schema: str) -> str:
    """EBNF of a JSON schema (JSON text) written as json.dumps writes it, `{"a": 1, "b": [2, 3]}`: the form
    chat templates render tool-call arguments in, and no free whitespace, so a model cannot stall in spaces.
    RequestError with the library's reason when it cannot compile the schema."""
    try:
        import xgrammar as xgr
    except ImportError:
        raise RequestError("tool calling needs the xgrammar package: pip install 'specc[serve]'") from None
    try:
        return str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, separators=(", ", ": "),
                                                strict_mode=True))
    except Exception as exc:  # xgrammar raises RuntimeError/ValueError with its own message
        raise RequestError(f"the schema could not be compiled: {_first_line(exc)}") from None


def _first_line(exc: Exception) -> str:
    """The library's message without its log prefix ("[12:00:00] /path/file.cc:123: ")."""
    lines = str(exc).strip().splitlines()
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", lines[0]) if lines else type(exc).__name__


def printable_mask(decoded_vocab: list[bytes], vocab_size: int, eos_ids: list[int]):
    """A token bitmask (int32 [ceil(V / 32)], xgrammar's layout) of the tokens whose bytes hold no control
    character (0x00-0x1f); stop tokens and ids past the tokenizer's vocabulary stay allowed."""
    import numpy as np
    import torch

    allowed = np.ones(-(-vocab_size // 32) * 32, dtype=bool)
    for i, text in enumerate(decoded_vocab[:vocab_size]):
        allowed[i] = not any(b < 0x20 for b in text)
    allowed[[i for i in eos_ids if 0 <= i < vocab_size]] = True
    words = np.packbits(allowed.reshape(-1, 32), axis=1, bitorder="little").view("<u4")[:, 0]
    return torch.from_numpy(words.astype(np.uint32).view(np.int32).copy())


class CompactJsonMatcher:
    """An xgrammar matcher whose masks also forbid tokens holding a raw control character. The grammars
    here are compact JSON (no free whitespace), where JSON allows none, but xgrammar's string rule admits
    them, and a strict parser refuses the result. The extra mask is part of the constraint the target is
    decoded under, applied alike to drafts and verification, so speculation stays exact."""

    def __init__(self, matcher, printable):
        self._m, self._printable = matcher, printable

    def fill_next_token_bitmask(self, bitmask, index: int = 0) -> None:
        self._m.fill_next_token_bitmask(bitmask, index)
        bitmask[index] &= self._printable

    def accept_token(self, token: int) -> bool:
        return self._m.accept_token(token)

    def rollback(self, n: int) -> None:
        self._m.rollback(n)

    def is_terminated(self) -> bool:
        return self._m.is_terminated()


def schema_text(schema) -> str:
    """A JSON schema given as a dict, a JSON string or JSON_OBJECT, as the text `Rules.json_schema` holds."""
    if isinstance(schema, str):
        return schema
    if isinstance(schema, (dict, bool)):
        return json.dumps(schema)  # key order kept: it is the order the grammar writes properties in
    raise RequestError(f"json_schema must be a JSON schema (a dict or JSON text), got {type(schema).__name__}")
