"""JSON grammars for structured output, with xgrammar (a matcher per request, rolled back after speculation).

xgrammar was chosen over llguidance because it installs as a wheel on this CPU, compiles a schema in
milliseconds, and its GrammarMatcher has `rollback`, which is what a verify pass needs: the matcher is
advanced over the drafts to mask each position, then rolled back to the committed output.
"""
from __future__ import annotations

import json
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
                    raise RequestError(f"json_schema could not be compiled: {str(exc).strip().splitlines()[0]}") from None
                self._cache[schema] = grammar
            return self._cache[schema]

    def matcher(self, schema: str):
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(schema))


def schema_text(schema) -> str:
    """A JSON schema given as a dict, a JSON string or JSON_OBJECT, as the text `Rules.json_schema` holds."""
    if isinstance(schema, str):
        return schema
    if isinstance(schema, (dict, bool)):
        return json.dumps(schema)  # key order kept: it is the order the grammar writes properties in
    raise RequestError(f"json_schema must be a JSON schema (a dict or JSON text), got {type(schema).__name__}")
