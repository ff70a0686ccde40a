"""JSON grammars for structured output, with xgrammar (a matcher per request, rolled back after speculation).

xgrammar was chosen over llguidance because it installs as a wheel on this CPU, compiles a schema in
milliseconds, and its GrammarMatcher has `rollback`, which is what a verify pass needs: the matcher is
advanced over the drafts to mask each position, then rolled back to the committed output.
"""
from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from ..errors import RequestError
from .grammar_keys import (JSON_OBJECT, TAG_KEY, UNSATISFIABLE, GrammarChecker, compile_key,  # noqa: F401 (re-exported)
                           too_slow)

MAX_SCHEMA_BYTES = 64 << 10  # a schema's JSON text; compile time grows faster than linearly with enums
MAX_SCHEMA_DEPTH = 32  # nested subschemas
MAX_PATTERN_CHARS = 1000
MAX_PATTERN_SIZE = 512  # a pattern's atoms once counted repetitions are expanded ({1,62} nested thrice: 7,688)
COMPILE_TIMEOUT_S = 10.0  # how long a request waits for its schema to compile
SEARCH_STATES = 512  # grammar states the satisfiability search may visit
SEARCH_SECONDS = 0.25  # and the wall time it may take: past either it gives up (the schema runs)
CACHE_ENTRIES = 256
CACHE_BYTES = 256 << 20

# keywords the grammar enforces (checked further in `check_schema`) and keywords that only annotate
ENFORCED = frozenset({
    "type", "enum", "const", "properties", "required", "additionalProperties", "patternProperties", "propertyNames",
    "minProperties", "maxProperties", "items", "prefixItems", "minItems", "maxItems", "uniqueItems", "anyOf", "oneOf",
    "allOf", "$ref", "$defs", "definitions", "pattern", "format", "minLength", "maxLength", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum"})
ANNOTATIONS = frozenset({"$schema", "$id", "$comment", "$anchor", "title", "description", "default", "examples",
                         "deprecated", "readOnly", "writeOnly", "discriminator", "contentMediaType"})
SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
SUBSCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
SUBSCHEMAS = ("additionalProperties", "propertyNames", "items")


GRAMMAR_THREAD_NICE = 10  # the compile thread: low, not lowest (it takes the interpreter lock between compiles)


def _low_priority(pid: int | None = None, nice: int = GRAMMAR_THREAD_NICE) -> None:
    """Run this thread (or process `pid`, 0 for this one) in the normal scheduling class at `nice` (Linux
    schedules threads one by one), out of a real-time class the server may run in, where a nice value counts
    for nothing: a schema compiling beside running requests takes little of their CPU. Not lower than a
    thread that takes the interpreter lock can bear: preempted while holding it, it holds up the engine
    thread until the scheduler runs it again."""
    import os

    pid = threading.get_native_id() if pid is None else pid
    try:
        if os.sched_getscheduler(pid) != os.SCHED_OTHER:
            os.sched_setscheduler(pid, os.SCHED_OTHER, os.sched_param(0))
        os.setpriority(os.PRIO_PROCESS, pid, nice)
    except (AttributeError, OSError):
        pass


class Grammars:
    """Compiles JSON schemas and structural tags (tool calls) against one model's tokenizer and makes matchers.

    Compiling runs on one low-priority thread of its own, never under a lock another request or the
    engine waits on; a caller waits at most COMPILE_TIMEOUT_S for it. Compiled grammars (and the
    errors of schemas and tags that failed) are kept in one LRU cache by schema text (TAG_KEY + tag text
    for a tag).

    With a checker (`use_checker`; `specc serve` gives it a worker process, serving/grammar_worker.py),
    each schema and tag is first compiled and searched there, bounded in time and memory, and compiled here
    only once it passed; without one, the satisfiability search runs in the caller's thread."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, sorted(eos_ids)
        self._compiler = None
        self._cache: OrderedDict[str, object] = OrderedDict()
        self._cache_bytes = 0
        self._pending: dict[str, Future] = {}
        self._lock = threading.Lock()  # held only to look up and update the cache, never while compiling
        self._pool: ThreadPoolExecutor | None = None
        self._admits: OrderedDict[str, bool | None] = OrderedDict()  # schema -> admits_output's verdict
        self.decoded: list[bytes] | None = None  # each token's own bytes (once the compiler is built)
        self.info = None  # xgrammar's TokenizerInfo (once the compiler is built)
        self.checker: GrammarChecker | None = None

    def use_checker(self, checker: "GrammarChecker") -> None:
        """Check every schema and tag not cached yet with `checker` before compiling it here."""
        self.checker = checker

    def decode_vocab(self) -> list[bytes] | None:
        """Each token's own bytes (a token may hold part of a character), as the grammar library decodes
        them; None without xgrammar."""
        try:
            self.compiler()
        except RequestError:
            return None
        return self.decoded

    def compiler(self):
        with self._lock:
            if self._compiler is None:
                try:
                    import xgrammar as xgr
                except ImportError:
                    raise RequestError("structured output needs the xgrammar package: pip install 'specc[serve]'") from None
                info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.eos_ids)
                self._printable = printable_mask(info.decoded_vocab, self.vocab_size, self.eos_ids)
                self._stops = printable_mask([b"\0"] * self.vocab_size, self.vocab_size, self.eos_ids)
                self.decoded, self.info = info.decoded_vocab, info
                # one thread per compile: the engine keeps the other cores
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def compile(self, schema: str, timeout: float = COMPILE_TIMEOUT_S):
        """The compiled grammar of a JSON schema (JSON text) or of JSON_OBJECT; RequestError naming what
        cannot be enforced, what the library could not compile, or that it took longer than `timeout`."""
        if schema != JSON_OBJECT:
            check_schema(schema)
        grammar = self._compiled(schema, timeout, "json_schema")
        if schema != JSON_OBJECT and self.checker is None and self._verdict(schema, grammar) is False:
            raise RequestError(UNSATISFIABLE)
        return grammar

    def _verdict(self, schema: str, grammar) -> bool | None:
        """admits_output for the compiled schema, searched once and remembered. It runs in the caller's thread,
        not the grammar thread: the search is Python holding the interpreter lock, and a low-priority thread
        preempted while holding it would stall the engine's thread waiting for it."""
        with self._lock:
            if schema in self._admits:
                self._admits.move_to_end(schema)
                return self._admits[schema]
        verdict = admits_output(self.matcher(schema, grammar), self.vocab_size)
        with self._lock:
            self._admits[schema] = verdict
            while len(self._admits) > CACHE_ENTRIES:
                self._admits.popitem(last=False)
        return verdict

    def compile_tag(self, tag: str, timeout: float = COMPILE_TIMEOUT_S):
        """The compiled grammar of an xgrammar structural tag (JSON text; tool calls, serving/tools.py), on the
        same low-priority thread, time limit and cache as schemas (keyed apart: TAG_KEY + the tag); RequestError
        naming what the library could not compile, or that it took longer than `timeout`. The tag's argument
        schemas are checked by the caller (serving/tools.py runs check_schema on each tool's parameters)."""
        return self._compiled(TAG_KEY + tag, timeout, "structural_tag")

    def _compiled(self, key: str, timeout: float, what: str):
        """The cached grammar of `key`, else compiled on the grammar thread while the caller waits at most
        `timeout` (the compile goes on, and is cached, when the caller stops waiting)."""
        self.compiler()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                found = self._cache[key]
            else:
                found = None
                future = self._pending.get(key)
                if future is None:
                    if self._pool is None:
                        self._pool = ThreadPoolExecutor(1, thread_name_prefix="specc-grammar", initializer=_low_priority)
                    future = self._pending[key] = self._pool.submit(self._build, key)
        if found is None:
            if self.checker is not None:
                self.checker.wait_ready()
            try:
                found = future.result(timeout)
            except FutureTimeout:
                raise RequestError(too_slow(what, timeout)) from None
        if isinstance(found, RequestError):
            raise RequestError(str(found))
        return found

    def _build(self, key: str):
        """Compile and check one schema or structural tag (the grammar thread); the grammar or the RequestError,
        cached."""
        tag = key.startswith(TAG_KEY)
        try:
            error = self.checker.check(key) if self.checker is not None else None
            if error:
                result = RequestError(error)
            elif tag:
                result = self._compile_tag(key[len(TAG_KEY):])
            else:
                result = self._compile_checked(key)
        except RequestError as exc:
            result = exc
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError (and MemoryError) with its own message
            result = RequestError(f"{'structural_tag' if tag else 'json_schema'} could not be compiled: "
                                  f"{_first_line(exc)}")
        size = getattr(result, "memory_size_bytes", 0)
        with self._lock:
            self._pending.pop(key, None)
            self._cache[key] = result
            self._cache_bytes += size
            while len(self._cache) > CACHE_ENTRIES or self._cache_bytes > CACHE_BYTES:
                _, old = self._cache.popitem(last=False)
                self._cache_bytes -= getattr(old, "memory_size_bytes", 0)
        return result

    def _compile_checked(self, schema: str):
        return compile_key(self._compiler, schema)

    def _compile_tag(self, tag: str):
        return compile_key(self._compiler, TAG_KEY + tag)

    def matcher(self, schema: str, grammar=None) -> "CompactJsonMatcher":
        """A matcher of `grammar` (already compiled for `schema`), else of the schema compiled now."""
        import xgrammar as xgr

        grammar = self.compile(schema) if grammar is None else grammar
        return CompactJsonMatcher(xgr.GrammarMatcher(grammar), self._printable, self._stops)

    def tag_matcher(self, tag: str, grammar=None) -> "TagMatcher":
        """A matcher of `grammar` (already compiled for the structural tag `tag`), else of the tag compiled now."""
        import xgrammar as xgr

        grammar = self.compile_tag(tag) if grammar is None else grammar
        return TagMatcher(xgr.GrammarMatcher(grammar), self._stops)


def check_schema(schema: str, name: str = "json_schema") -> None:
    """RequestError for a schema too large to compile in bounded time, or using a keyword the grammar
    cannot enforce (its output could then break the schema): one message naming the keyword and where.
    name: what the message calls the schema (a tool's parameters: "tools.0.function.parameters: tool 'f'")."""
    if len(schema.encode("utf-8", "replace")) > MAX_SCHEMA_BYTES:
        raise RequestError(f"{name} is {len(schema.encode('utf-8', 'replace'))} bytes of JSON; allowed at most "
                           f"{MAX_SCHEMA_BYTES}")
    try:
        node = json.loads(schema)
    except ValueError as exc:
        raise RequestError(f"{name} is not valid JSON: {exc}") from None
    _check_node(node, "schema", 0, name)


def _check_node(node, where: str, depth: int, name: str) -> None:
    if isinstance(node, bool):
        return
    if not isinstance(node, dict):
        raise RequestError(f"{name}: {where} must be a schema (an object or a boolean), got {type(node).__name__}")
    if depth > MAX_SCHEMA_DEPTH:
        raise RequestError(f"{name}: {where} is nested deeper than {MAX_SCHEMA_DEPTH} subschemas")
    for key, value in node.items():
        if key not in ENFORCED and key not in ANNOTATIONS:
            raise RequestError(f"{name}: {where}.{key}: the keyword {key!r} is not enforced by specc's grammar, so "
                               "the output could break it; remove it. Enforced: " + ", ".join(sorted(ENFORCED)))
    _check_keywords(node, where, name)
    for key in SUBSCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            for prop, sub in node[key].items():
                _check_node(sub, f"{where}.{key}.{prop}", depth + 1, name)
    for key in SUBSCHEMA_LISTS:
        if isinstance(node.get(key), list):
            for i, sub in enumerate(node[key]):
                _check_node(sub, f"{where}.{key}.{i}", depth + 1, name)
    for key in SUBSCHEMAS:
        if isinstance(node.get(key), (dict, bool)):
            _check_node(node[key], f"{where}.{key}", depth + 1, name)


def _check_keywords(node: dict, where: str, name: str) -> None:
    """The enforced keywords' own limits: what the grammar writes for them must be what they mean."""
    if node.get("uniqueItems") not in (None, False):
        raise RequestError(f"{name}: {where}.uniqueItems: the keyword 'uniqueItems' is not enforced by specc's "
                           "grammar (it can repeat an item); remove it or set it to false")
    all_of = node.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        raise RequestError(f"{name}: {where}.allOf: the keyword 'allOf' with {len(all_of)} schemas is not "
                           "enforced by specc's grammar; merge them into one schema (allOf of one schema is allowed)")
    one_of = node.get("oneOf")
    if isinstance(one_of, list) and not _disjoint_types(one_of):
        raise RequestError(f"{name}: {where}.oneOf: the keyword 'oneOf' is enforced only when its schemas have "
                           "different types (the grammar cannot keep a value from matching two of them); use anyOf")
    required, properties = node.get("required"), node.get("properties")
    if isinstance(required, list):
        names = properties if isinstance(properties, dict) else {}
        missing = [r for r in required if r not in names]
        if missing:
            raise RequestError(f"{name}: {where}.required: {missing[0]!r} is required but not defined in "
                               "properties; the grammar writes only the properties the schema defines, so the "
                               "output could never hold it")
    pattern = node.get("pattern")
    if isinstance(pattern, str):
        _check_pattern(pattern, f"{where}.pattern", name)


def _disjoint_types(schemas: list) -> bool:
    """Each schema names one type (`type` a string) and no two the same ("number" covers "integer")."""
    seen: set[str] = set()
    for sub in schemas:
        kind = sub.get("type") if isinstance(sub, dict) else None
        if not isinstance(kind, str):
            return False
        kind = "number" if kind == "integer" else kind
        if kind in seen:
            return False
        seen.add(kind)
    return True


def _check_pattern(pattern: str, where: str, name: str) -> None:
    if len(pattern) > MAX_PATTERN_CHARS:
        raise RequestError(f"{name}: {where} is {len(pattern)} characters; allowed at most {MAX_PATTERN_CHARS}")
    import re._parser as sre

    try:
        size = _pattern_size(sre.parse(pattern).data)
    except (re.error, RecursionError, OverflowError):
        return  # not a Python regex: the grammar library judges it, within the compile time limit
    if size > MAX_PATTERN_SIZE:
        raise RequestError(f"{name}: {where} expands to {size} atoms once its counted repetitions are written "
                           f"out; allowed at most {MAX_PATTERN_SIZE} (use smaller counts, or nest fewer of them)")


def _pattern_size(items) -> int:
    """Atoms of a parsed regex with each counted repetition written out ({m,n}: n copies; unbounded: one loop)."""
    import re._constants as c

    total = 0
    for op, av in items:
        if op in (c.MAX_REPEAT, c.MIN_REPEAT, getattr(c, "POSSESSIVE_REPEAT", c.MAX_REPEAT)):
            lo, hi, sub = av
            total += max(lo, 1 if hi == c.MAXREPEAT else hi) * _pattern_size(sub)
        elif op == c.SUBPATTERN:
            total += _pattern_size(av[-1])
        elif op == c.BRANCH:
            total += sum(_pattern_size(b) for b in av[1])
        elif op in (c.ASSERT, c.ASSERT_NOT):
            total += _pattern_size(av[1])
        else:
            total += 1
    return total


def admits_output(matcher: "CompactJsonMatcher", vocab: int, budget: int = SEARCH_STATES,
                  seconds: float = SEARCH_SECONDS) -> bool | None:
    """Whether some output completes the grammar under the masks: True (found one), False (every path
    ends where no token is allowed), None (undecided within `budget` states or `seconds`: assumed to)."""
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(1, vocab)
    visited = 0
    deadline = time.monotonic() + seconds

    def search(depth: int) -> bool | None:
        nonlocal visited
        visited += 1
        if visited > budget or depth > 64 or time.monotonic() > deadline:
            return None
        if not matcher.fill_next_token_bitmask(bitmask):
            return False
        if matcher.stop_allowed():
            return True
        undecided = False
        for token in allowed_ids(bitmask[0], vocab):
            if not matcher.accept_token(token):
                continue
            found = search(depth + 1)
            matcher.rollback(1)
            if found:
                return True
            undecided |= found is None
            if visited > budget:
                return None
        return None if undecided else False

    return search(0)


def allowed_ids(words, vocab: int) -> list[int]:
    """Token ids set in one row of a token bitmask (int32 words, xgrammar's layout)."""
    import torch

    bits = (words.to(torch.int64)[:, None] >> torch.arange(32)) & 1
    return bits.flatten()[:vocab].nonzero()[:, 0].tolist()


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
    decoded under, applied alike to drafts and verification, so speculation stays exact.

    Where the two masks leave no token (a pattern that needs a control character), the mask allows only
    the stop tokens, so the row's distribution stays defined and it ends; `stop_allowed` then says the
    output is incomplete, and the runtime fails that request alone."""

    def __init__(self, matcher, printable, stops):
        self._m, self._printable, self._stops = matcher, printable, stops

    def fill_next_token_bitmask(self, bitmask, index: int = 0) -> bool:
        """The mask at the next position; False where the grammar allows tokens but none the printable
        mask lets through (a grammar that allows nothing at all is complete, with no stop token in the
        vocabulary)."""
        self._m.fill_next_token_bitmask(bitmask, index)
        if bool((bitmask[index] == 0).all()):
            return True
        bitmask[index] &= self._printable
        if bool((bitmask[index] == 0).all()):
            bitmask[index] = self._stops
            return False
        return True

    def stop_allowed(self) -> bool:
        """The output so far is complete: the grammar accepts a stop token here (or nothing at all)."""
        import xgrammar as xgr

        if self._m.is_terminated():
            return True
        bitmask = xgr.allocate_token_bitmask(1, self._stops.shape[0] * 32)
        self._m.fill_next_token_bitmask(bitmask)
        return bool(((bitmask[0] & self._stops) != 0).any() or (bitmask[0] == 0).all())

    def accept_token(self, token: int) -> bool:
        return self._m.accept_token(token)

    def rollback(self, n: int) -> None:
        self._m.rollback(n)

    def is_terminated(self) -> bool:
        return self._m.is_terminated()


class TagMatcher(CompactJsonMatcher):
    """A structural tag's matcher (tool calls): the grammar's own masks, with no printable mask, since the text
    around calls may hold newlines (raw control characters inside argument strings are escaped when the reply
    is read, serving/tools.escape_controls). It keeps CompactJsonMatcher's contract for the runtime
    (`fill_next_token_bitmask` returns whether the row can go on, `stop_allowed`), so a dead end fails only
    its own row."""

    def __init__(self, matcher, stops):
        super().__init__(matcher, None, stops)

    def fill_next_token_bitmask(self, bitmask, index: int = 0) -> bool:
        self._m.fill_next_token_bitmask(bitmask, index)
        return True


def schema_text(schema) -> str:
    """A JSON schema given as a dict, a JSON string or JSON_OBJECT, as the text `Rules.json_schema` holds."""
    if isinstance(schema, str):
        return schema
    if isinstance(schema, (dict, bool)):
        return json.dumps(schema)  # key order kept: it is the order the grammar writes properties in
    raise RequestError(f"json_schema must be a JSON schema (a dict or JSON text), got {type(schema).__name__}")
