"""The bundle manifest: its typed form (`Manifest`), validated in one place (`Manifest.from_dict`: any
missing field, wrong type or out-of-range value is one BundleError naming the field), read from disk
(`read_manifest`), and the bundle id: `sha256:` + sha256 of the canonical manifest (`canonical_json`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import BundleError, RecipeError
from ..methods import METHODS
from ..recipe import Recipe, parse_recipe
from ..version import __version__

FORMAT = "specc-bundle"
FORMAT_VERSION = 2
MAX_TOKEN_ID = 2**31  # token ids are int32-sized everywhere (tokenizers, ONNX graphs)
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 64 << 20
ID_PREFIX = "sha256:"
_ID = re.compile(r"(?:sha256:)?([0-9a-f]{64})")
_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+-]*")


def canonical_json(manifest: dict) -> bytes:
    """The bytes the bundle id hashes: the parsed manifest, keys sorted, no whitespace, ASCII only."""
    return json.dumps(manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def bundle_id(manifest: dict) -> str:
    return ID_PREFIX + hashlib.sha256(canonical_json(manifest)).hexdigest()


def normalize_id(value: str) -> str:
    """'sha256:<64 hex>' (or the bare hex) as the canonical id string; BundleError otherwise."""
    match = _ID.fullmatch(value.strip().lower()) if isinstance(value, str) else None
    if not match:
        raise BundleError(f"expected bundle id {value!r} is not 'sha256:' followed by 64 hex digits "
                          "(`specc inspect BUNDLE` prints the id)")
    return ID_PREFIX + match.group(1)


def check_relpath(rel: Any, where: str) -> str:
    """A path inside the bundle: relative POSIX, no '..', '.', empty parts, or unusual characters."""
    if not isinstance(rel, str) or not rel:
        raise BundleError(f"manifest field '{where}': expected a relative path, got {rel!r}")
    parts = rel.split("/")
    if rel.startswith("/") or any(p in ("", ".", "..") or not _PART.fullmatch(p) for p in parts) or rel == MANIFEST:
        raise BundleError(f"manifest field '{where}': {rel!r} is not a plain relative path inside the bundle "
                          "(no absolute paths, '..', '.', empty parts, or characters outside A-Z a-z 0-9 _ . + -)")
    return rel


# -- the typed manifest -----------------------------------------------------------------------
class _Reader:
    """Typed access to one JSON object of the manifest; errors name the field path."""

    def __init__(self, data: Any, where: str):
        if not isinstance(data, dict):
            raise BundleError(f"manifest field '{where or '<root>'}': expected an object, got {_short(data)}")
        self.data, self.where = data, where

    def path(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def fail(self, key: str, problem: str) -> BundleError:
        return BundleError(f"manifest field '{self.path(key)}': {problem}")

    def get(self, key: str, kinds: tuple, what: str, optional: bool = False) -> Any:
        if key not in self.data:
            if optional:
                return None
            raise self.fail(key, f"missing (expected {what}); the bundle is corrupt, compile it again")
        value = self.data[key]
        if value is None and optional:
            return None
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            raise self.fail(key, f"expected {what}, got {_short(value)}")
        return value

    def str(self, key: str, optional: bool = False) -> str | None:
        return self.get(key, (str,), "a string", optional)

    def int(self, key: str, lo: int = 0, optional: bool = False) -> int | None:
        value = self.get(key, (int,), "an integer", optional)
        if value is not None and value < lo:
            raise self.fail(key, f"{value} is below the minimum {lo}")
        return value

    def bool(self, key: str) -> bool:
        return self.get(key, (bool,), "true or false")

    def obj(self, key: str, optional: bool = False) -> "_Reader | None":
        value = self.get(key, (dict,), "an object", optional)
        return None if value is None else _Reader(value, self.path(key))

    def str_list(self, key: str) -> list[str]:
        value = self.get(key, (list,), "a list of strings")
        if not all(isinstance(v, str) for v in value):
            raise self.fail(key, f"expected a list of strings, got {_short(value)}")
        return list(value)

    def str_map(self, key: str) -> dict[str, str]:
        value = self.get(key, (dict,), "an object of strings")
        if not all(isinstance(v, str) for v in value.values()):
            raise self.fail(key, f"expected an object of strings, got {_short(value)}")
        return dict(value)


def _short(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"


@dataclass(frozen=True)
class FileEntry:
    sha256: str
    bytes: int


@dataclass(frozen=True)
class TensorSig:
    name: str
    dtype: str
    shape: list  # ints and named dims


DTYPES = ("int64", "int32", "float32", "float16", "bfloat16", "bool")
# The graph ABIs: the step graph (capture/step_decoder.py, passes) and the draft heads (heads/graph.py: Medusa,
# EAGLE). Inputs: one ABI in this order, then optional extras, each once; outputs: one ABI, then optional extras.
STEP_INPUTS = ("input_ids", "position_ids", "cache_len", "logit_index", "k_cache", "v_cache")
INPUT_ABIS = (STEP_INPUTS, ("features",),
              ("input_ids", "features", "position_ids", "cache_len", "logit_index", "k_cache", "v_cache"))
EXTRA_INPUTS = ("tree_mask", "draft_tokens", "draft_probs", "n_draft", "temperature", "top_k", "top_p", "u_accept", "u_next")
STEP_OUTPUTS = (("logits", "new_k", "new_v"), ("n_accepted", "next_token", "new_k", "new_v"), ("logits",),
                ("logits", "hidden", "new_k", "new_v"))
EXTRA_OUTPUTS = ("features",)  # passes/add_feature_outputs.py


def _follows_abi(names: list[str], abis: tuple, extras: tuple) -> bool:
    """names = one of the ABIs, then any of the extras, no name twice."""
    return len(set(names)) == len(names) and any(
        tuple(names[:len(abi)]) == abi and set(names[len(abi):]) <= set(extras) for abi in abis)
MODEL_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class GraphEntry:
    """One step graph: its directory, files, I/O signature; `facts` holds the backend's own fields."""

    dir: str
    entry: str
    files: list[str]
    inputs: list[TensorSig]
    outputs: list[str]
    ranges: dict[str, list[int]]
    model: dict  # ModelDims fields
    quantize: str | None = None
    passes: list = field(default_factory=list)
    facts: dict = field(default_factory=dict)  # backend facts: versions, opset, profiles, numerics, gpu, ...

    KNOWN = ("dir", "entry", "files", "inputs", "outputs", "ranges", "model", "quantize", "passes")

    def to_dict(self) -> dict:
        """The manifest's JSON form (what backends receive)."""
        out = {"dir": self.dir, "entry": self.entry, "files": list(self.files),
               "inputs": [dataclasses.asdict(i) for i in self.inputs], "outputs": list(self.outputs),
               "ranges": {k: list(v) for k, v in self.ranges.items()}, "model": dict(self.model),
               "quantize": self.quantize, "passes": list(self.passes)}
        return {**self.facts, **out}

    @classmethod
    def read(cls, r: _Reader) -> "GraphEntry":
        d = check_relpath(r.str("dir"), r.path("dir"))
        if "/" in d:
            raise r.fail("dir", f"{d!r}: a graph directory is one name at the bundle's top")
        files = r.str_list("files")
        for i, f in enumerate(files):
            check_relpath(f, f"{r.path('files')}[{i}]")
        entry = r.str("entry")
        if entry not in files:
            raise r.fail("entry", f"{entry!r} is not one of the graph's files {files}")
        inputs = []
        for i, raw in enumerate(r.get("inputs", (list,), "a list of inputs")):
            ir = _Reader(raw, f"{r.path('inputs')}[{i}]")
            shape = ir.get("shape", (list,), "a list of dimensions")
            if not all(isinstance(s, str) or (isinstance(s, int) and not isinstance(s, bool) and s >= 0) for s in shape):
                raise ir.fail("shape", f"dimensions must be names or integers >= 0, got {_short(shape)}")
            dtype = ir.str("dtype")
            if dtype not in DTYPES:
                raise ir.fail("dtype", f"{dtype!r} is not one of {', '.join(DTYPES)}")
            inputs.append(TensorSig(ir.str("name"), dtype, list(shape)))
        names = [i.name for i in inputs]
        if not _follows_abi(names, INPUT_ABIS, EXTRA_INPUTS):
            raise r.fail("inputs", f"{names} is not the step-graph ABI: {' or '.join(map(str, map(list, INPUT_ABIS)))}, "
                                   f"then any of {', '.join(EXTRA_INPUTS)}, each once")
        outputs = r.str_list("outputs")
        if not _follows_abi(outputs, STEP_OUTPUTS, EXTRA_OUTPUTS):
            raise r.fail("outputs", f"{outputs} is not the step-graph ABI: {' or '.join(map(str, map(list, STEP_OUTPUTS)))}, "
                                    f"then any of {', '.join(EXTRA_OUTPUTS)}")
        rr = r.obj("ranges")
        ranges = {}
        for name, value in rr.data.items():
            if not (isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
                    and 0 <= value[0] <= value[1]):
                raise rr.fail(name, f"expected [min, max] integers with 0 <= min <= max, got {_short(value)}")
            ranges[name] = list(value)
        mr = r.obj("model")
        kv = 1 if "k_cache" in names else 0  # a graph without a KV cache (a Medusa head) has no layers to size one
        model = {"n_layers": mr.int("n_layers", kv), "n_kv_heads": mr.int("n_kv_heads", kv),
                 "head_dim": mr.int("head_dim", kv), "vocab_size": mr.int("vocab_size", 1), "dtype": mr.str("dtype")}
        if model["dtype"] not in MODEL_DTYPES:
            raise mr.fail("dtype", f"{model['dtype']!r} is not one of {', '.join(MODEL_DTYPES)}")
        unknown = set(mr.data) - set(model)
        if unknown:
            raise mr.fail(sorted(unknown)[0], "unknown field")
        quantize = r.str("quantize", optional=True)
        passes = r.get("passes", (list,), "a list", optional=True) or []
        facts = {k: v for k, v in r.data.items() if k not in cls.KNOWN}
        return cls(d, entry, files, inputs, outputs, ranges, model, quantize, list(passes), facts)


@dataclass(frozen=True)
class DraftInfo:
    method: str
    graph: str | None
    shares_target_cache: bool
    layer: int | None
    adapter: dict | None


@dataclass(frozen=True)
class TokenizerInfo:
    dir: str
    eos_token_ids: list[int]


@dataclass(frozen=True)
class Manifest:
    """The validated manifest; `raw` is the parsed JSON it came from and `id` its bundle id."""

    backend: str
    recipe: Recipe
    versions: dict[str, str]
    models: dict[str, str | None]  # target, draft
    draft: DraftInfo
    tokenizer: TokenizerInfo
    graphs: dict[str, GraphEntry]
    files: dict[str, FileEntry]
    specc_version: str
    compile_seconds: dict
    raw: dict = field(repr=False, compare=False)
    id: str = ""

    TOP = ("format", "format_version", "specc_version", "backend", "recipe", "versions", "models", "draft",
           "tokenizer", "graphs", "files", "compile_seconds")

    @property
    def format(self) -> str:
        return FORMAT

    @property
    def format_version(self) -> int:
        return FORMAT_VERSION

    def graph(self, role: str) -> GraphEntry | None:
        return self.graphs.get(role)

    def to_dict(self) -> dict:
        return json.loads(json.dumps(self.raw))

    @classmethod
    def from_dict(cls, data: Any) -> "Manifest":
        """Validate a parsed manifest; one BundleError naming the first field that is wrong."""
        r = _Reader(data, "")
        fmt = data.get("format")
        if fmt != FORMAT:
            raise BundleError(f"not a specc manifest (format {fmt!r}, expected {FORMAT!r})")
        version = data.get("format_version")
        if version != FORMAT_VERSION or isinstance(version, bool):
            raise BundleError(
                f"bundle format version {version!r} is not supported by specc {__version__} (it reads version "
                f"{FORMAT_VERSION}); compile the recipe again with this specc")
        unknown = sorted(set(data) - set(cls.TOP))
        if unknown:
            raise r.fail(unknown[0], f"unknown field; allowed: {', '.join(cls.TOP)}")
        backend = r.str("backend")
        try:
            recipe = parse_recipe(r.obj("recipe").data, "manifest recipe")
        except RecipeError as exc:
            raise BundleError(f"manifest field 'recipe.{exc.path}': {str(exc).split(': ', 1)[1]}") from None
        if recipe.backend != backend:
            raise r.fail("backend", f"{backend!r} differs from recipe.backend {recipe.backend!r}")
        mr = r.obj("models")
        models = {"target": mr.str("target"), "draft": mr.str("draft", optional=True)}
        dr = r.obj("draft")
        layer = dr.int("layer", 1, optional=True)
        draft = DraftInfo(dr.str("method"), dr.str("graph", optional=True), dr.bool("shares_target_cache"), layer,
                          dr.get("adapter", (dict,), "an object", optional=True))
        if draft.method != recipe.draft.method:
            raise dr.fail("method", f"{draft.method!r} differs from recipe.draft.method {recipe.draft.method!r}")
        tr = r.obj("tokenizer")
        eos = tr.get("eos_token_ids", (list,), "a list of token ids")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in eos):
            raise tr.fail("eos_token_ids", f"expected a list of token ids (integers >= 0), got {_short(eos)}")
        tokenizer = TokenizerInfo(check_relpath(tr.str("dir"), tr.path("dir")), list(eos))
        gr = r.obj("graphs")
        graphs = {role: GraphEntry.read(_Reader(g, gr.path(role))) for role, g in gr.data.items()}
        if "target" not in graphs:
            raise gr.fail("target", "missing; every bundle has a target graph")
        if draft.graph is not None and draft.graph not in graphs:
            raise dr.fail("graph", f"{draft.graph!r} is not one of the graphs ({', '.join(graphs)})")
        if draft.method in METHODS and (draft.graph is not None) != (METHODS[draft.method].graph is not None):
            raise dr.fail("graph", f"{draft.graph!r} does not fit draft method {draft.method!r}")
        vocab = graphs["target"].model["vocab_size"]
        for role, g in graphs.items():
            if g.model["vocab_size"] != vocab:
                raise gr.fail(f"{role}.model.vocab_size", f"{g.model['vocab_size']} differs from the target's {vocab}")
        if any(t >= MAX_TOKEN_ID for t in eos):  # ids past the model's vocabulary are legal (never generated)
            raise tr.fail("eos_token_ids", f"{eos} has ids outside the vocabulary of token ids [0, {MAX_TOKEN_ID})")
        fr = r.obj("files")
        files = {}
        for rel, meta in fr.data.items():
            check_relpath(rel, f"files.{rel}")
            m = _Reader(meta, f"files.{rel}")
            digest = m.str("sha256")
            if not re.fullmatch(r"[0-9a-f]{64}", digest):
                raise m.fail("sha256", f"expected 64 lowercase hex digits, got {digest!r}")
            files[rel] = FileEntry(digest, m.int("bytes", 0))
        for role, g in graphs.items():
            listed = {f"{g.dir}/{f}" for f in g.files}
            missing = sorted(listed - set(files))
            if missing:
                raise gr.fail(f"{role}.files", f"{missing[0]} is not in the manifest's file table")
            extra = sorted(rel for rel in files if rel.startswith(g.dir + "/") and rel not in listed)
            if extra:
                raise gr.fail(f"{role}.files", f"{extra[0]} lies in the graph directory but is not one of the graph's files")
        if not any(rel.startswith(tokenizer.dir + "/") for rel in files):
            raise tr.fail("dir", f"no file of the manifest's file table lies in {tokenizer.dir!r}")
        versions = r.str_map("versions")
        compile_seconds = r.get("compile_seconds", (dict,), "an object", optional=True) or {}
        try:
            ident = bundle_id(data)
        except ValueError as exc:  # NaN or infinity somewhere
            raise BundleError(f"manifest holds a value JSON does not allow ({exc})") from None
        return cls(backend, recipe, versions, models, draft, tokenizer, graphs, files, r.str("specc_version"),
                   compile_seconds, data, ident)


def _no_duplicates(pairs: list) -> dict:
    keys = [k for k, _ in pairs]
    if len(keys) != len(set(keys)):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise BundleError(f"manifest has the key {dup!r} twice in one object; the bundle is corrupt or tampered with")
    return dict(pairs)


def read_manifest(path: str | Path) -> Manifest:
    """Read and validate a bundle's manifest (no file is checked here; see `open_bundle`)."""
    path = Path(path)
    if not path.exists():
        raise BundleError(f"bundle {path} does not exist; build one with `specc compile RECIPE`")
    if not path.is_dir():
        raise BundleError(f"{path} is not a bundle directory")
    file = path / MANIFEST
    try:
        st = os.lstat(file)
    except FileNotFoundError:
        raise BundleError(f"{path} is not a specc bundle: it has no {MANIFEST}") from None
    except OSError as exc:
        raise BundleError(f"cannot read {file}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise BundleError(f"{file} is not a regular file (symlinks and special files are refused)")
    if st.st_size > MAX_MANIFEST_BYTES:
        raise BundleError(f"{file} is {st.st_size} bytes, above the {MAX_MANIFEST_BYTES >> 20} MiB a manifest may have")
    try:
        data = json.loads(file.read_bytes().decode("utf-8"), object_pairs_hook=_no_duplicates,
                          parse_constant=_refuse_constant)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise BundleError(f"{file} is not valid JSON ({type(exc).__name__}: {str(exc)[:120]}); "
                          "the bundle is corrupt, compile it again") from None
    except OSError as exc:
        raise BundleError(f"cannot read {file}: {exc.strerror or exc}") from None
    if not isinstance(data, dict):
        raise BundleError(f"{file} is not a specc manifest (expected a JSON object, got {type(data).__name__})")
    try:
        return Manifest.from_dict(data)
    except RecursionError:
        raise BundleError(f"{file} nests too deeply to be a specc manifest") from None


def _refuse_constant(name: str):
    raise BundleError(f"manifest holds {name}, which JSON does not allow; the bundle is corrupt or tampered with")
