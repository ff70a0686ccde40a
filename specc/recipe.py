"""The recipe: one validated schema for what `specc compile` builds.

Every field is declared once, with its type, default, allowed values and help text;
validation, `specc compile --help` and the defaults written into bundles all come from
these declarations. Errors name the field path and what is allowed.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .errors import RecipeError
from .limits import (AUTO_K_MAX, MAX_K, MAX_LOOKAHEAD_NGRAM, MAX_LOOKAHEAD_VERIFY, MAX_LOOKAHEAD_WINDOW, MAX_NGRAM,
                     MAX_TREE_BRANCHING, MAX_TREE_DEPTH, MAX_TREE_NODES)
from .methods import METHOD_FIELDS, METHODS, SUFFIX_SETTINGS, DraftMethod, get_method, methods_with
from .speculation.tree import TreeShape

BACKENDS = ("onnxruntime", "torch", "aoti", "tensorrt", "torch_tensorrt")
PRECISIONS = ("fp32", "fp16", "bf16")
GGUF_BLOCK_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K")  # GGUF blocks that map exactly onto MatMulNBits


def _f(default: Any, help: str, *, choices: tuple = (), lo: float | None = None, hi: float | None = None,
       also: tuple = ()):
    """A recipe field: default, help text and constraints in one place; `also`: special values allowed
    beside the typed ones (speculation.k: auto)."""
    meta = {"help": help, "choices": choices, "lo": lo, "hi": hi, "also": also}
    if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
        return field(default_factory=lambda: _copy(default), metadata=meta)
    return field(default=default, metadata=meta)


def _copy(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return dataclasses.replace(value)
    return type(value)(value)


@dataclass(frozen=True)
class TargetSpec:
    model: str = _f(None, "catalog name (`specc models list`), Hugging Face model directory, or .gguf file")
    dtype: str = _f("float32", "weights and activations dtype of the traced graph", choices=("float32", "float16", "bfloat16"))
    quantize: str | None = _f(None, "quantisation of the target's linear layers: int8/int4 weight-only blocks (onnxruntime: "
                                    "MatMulNBits; tensorrt: DequantizeLinear → MatMul weight-only form, fp8 too), or int8-gemm "
                                    "(onnxruntime: int8 weights per output channel on the integer GEMM, activations per row in "
                                    "two int8 parts), or int4-gemm (onnxruntime: specc's own kernels, 4-bit blocks of 32 times "
                                    "int8 activations, a GGUF's Q4 blocks kept; the fastest decode and verify on x86 CPUs); "
                                    "speculation stays lossless relative to this quantised target",
                             choices=("int8", "int4", "int8-gemm", "int4-gemm", "fp8"))
    block_size: int = _f(32, "target.quantize: weights per quantisation block (one scale each)", choices=(16, 32, 64, 128, 256))
    accuracy_level: int = _f(4, "target.quantize: MatMulNBits compute type: 4 int8 activations (fastest here), 1 float32",
                             choices=(0, 1, 2, 3, 4))
    keep_float: list = _f([], "target.quantize: linear layers left in float32, by module name or glob "
                              "(lm_head, layers.0.*, *.down_proj)")
    gguf_blocks: bool = _f(True, "target.quantize with a GGUF source (file or catalog model): keep the GGUF's own quantised "
                                 "blocks where they map exactly onto MatMulNBits (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) instead of "
                                 "rounding the dequantised weights a second time")
    gguf_requantize: list = _f([], "target.gguf_blocks: GGUF block types rounded again to target.quantize instead of kept "
                                   "(e.g. [Q6_K]: kept, Q6_K blocks run as 8 bits; requantised, as int4 at a quality cost)")


@dataclass(frozen=True)
class DraftSpec:
    method: str = _f("model", "how draft tokens are proposed (specc/methods.py: what each can do)", choices=METHODS)
    model: str | None = _f(None, "draft model (method: model): catalog name, HF directory or .gguf file")
    quantize: str | None = _f(None, "weight quantisation of the draft graph (onnxruntime backend; a draft model or a "
                                    "learned head): int8, int4 (ONNX Runtime's kernels) or int4-gemm (specc's own, as "
                                    "target.quantize: int4-gemm; a GGUF draft's Q4 blocks kept)",
                             choices=("int8", "int4", "int4-gemm"))
    layer: int | None = _f(None, "method: early_exit — exit after this many target layers", lo=1, hi=1 << 16)
    adapter: str | None = _f(None, "method: early_exit — safetensors file from `specc train-exit-head`")
    head: str | None = _f(None, "method: medusa or eagle — head directory from `specc train-head`, or a published Medusa / "
                                "EAGLE-1/2 or EAGLE-3 head (config.json + safetensors)")
    lookup: bool = _f(False, "method model, quantized, early_exit or eagle (chain mode): draft by prompt lookup in rounds where "
                             "every row finds an n-gram continuation; the model (or head) drafts the other rounds")
    suffix: bool = _f(False, "method model, quantized, early_exit, eagle or lookahead: draft by suffix decoding (the "
                             "request's own context and the outputs of earlier requests) in rounds where every row finds a "
                             "continuation; "
                             "the model (or head) drafts the other rounds. Not with lookup: the suffix index already holds "
                             "the request's context")
    suffix_requests: int = _f(256, "method suffix, or suffix: true — outputs of this many recent requests kept to draft from "
                                   "(least recently matched evicted first; 0: the request's own context only)", lo=0, hi=1 << 20)
    suffix_tokens: int = _f(262144, "method suffix, or suffix: true — most tokens kept over those outputs (the global index "
                                    "takes a few hundred bytes a token)", lo=0, hi=1 << 26)
    max_ngram: int = _f(3, "prompt lookup (method prompt_lookup, or lookup: true) — longest n-gram matched against the context",
                        lo=1, hi=MAX_NGRAM)
    min_ngram: int = _f(1, "prompt lookup — shortest n-gram tried before giving up", lo=1, hi=MAX_NGRAM)
    window: int = _f(4, "method lookahead — lanes of its lookahead branch (W): each guesses ngram - 1 future tokens by "
                        "Jacobi iteration and adds an n-gram to the pool every round", lo=1, hi=MAX_LOOKAHEAD_WINDOW)
    ngram: int = _f(3, "method lookahead — tokens of its n-grams (N): a lane guesses N - 1 tokens, a verified n-gram "
                       "drafts N - 1", lo=2, hi=MAX_LOOKAHEAD_NGRAM)
    verify_ngrams: int = _f(4, "method lookahead — n-grams of the pool that start with the last token, verified each "
                               "round (G; 0: only the lanes)", lo=0, hi=MAX_LOOKAHEAD_VERIFY)
    vocab: int | None = _f(None, "method model: the draft's LM head keeps only the first this many token ids and the "
                                 "tokenizer's special tokens (byte-level BPE numbers tokens by merge order, roughly by "
                                 "frequency: FR-Spec's frequency-ranked draft vocabulary). Each draft step reads a smaller "
                                 "head; drafts come from those tokens only and the target still verifies over its whole "
                                 "vocabulary, so output stays exact (null: the whole vocabulary)", lo=1, hi=1 << 22)
    stop_below: float = _f(0.0, "method model, quantized, early_exit or eagle (chain mode): a row's drafts end after the "
                                "first one the drafter gave a probability below this (0: always k drafts); under k auto any "
                                "value above 0 turns early stops on at a threshold the policy sets from measured costs (a chain "
                                "ends once the product of its drafts' probabilities is below what one more draft costs in "
                                "tokens); the drafter's own draws decide, so output stays exact", lo=0.0, hi=1.0)


@dataclass(frozen=True)
class TreeSpec:
    paths: list | None = _f(None, "static tree: list of branch paths, e.g. [[0], [1], [0, 0]] (Medusa choices)")
    depth: int = _f(4, "dynamic tree: levels drafted", lo=1, hi=MAX_TREE_DEPTH)
    branching: int = _f(2, "dynamic tree: children kept per node (top-k of the draft)", lo=1, hi=MAX_TREE_BRANCHING)
    max_nodes: int = _f(16, "dynamic tree: most draft nodes drafted, and verified in one target pass", lo=1, hi=MAX_TREE_NODES)
    verify_nodes: int | None = _f(None, "dynamic tree, EAGLE-2 style: grow only each level's `branching` most likely nodes "
                                        "(up to max_nodes drafted), then verify the verify_nodes most likely of them "
                                        "(greedy rows; sampled rows verify all they drafted)", lo=1, hi=MAX_TREE_NODES)


@dataclass(frozen=True)
class SpeculationSpec:
    mode: str = _f("chain", "chain: k tokens in a row; tree: a token tree verified in one pass", choices=("chain", "tree"))
    k: int | str = _f("auto", f"chain mode: auto, chosen every round (0 to {AUTO_K_MAX}) from the measured acceptance "
                              "and costs (rounds where drafting does not pay decode plainly); or a fixed "
                              "number of draft tokens per round", lo=1, hi=MAX_K, also=("auto",))
    tree: TreeSpec = _f(TreeSpec(), "tree mode: shape of the token tree")
    verify_head: bool = _f(False, "compute acceptance inside the target graph (verification-head pass)")


@dataclass(frozen=True)
class SamplingSpec:
    temperature: float = _f(0.0, "0 means greedy", lo=0.0, hi=100.0)
    top_k: int = _f(0, "keep the k most likely tokens; 0 keeps all", lo=0, hi=2**31 - 1)
    top_p: float = _f(1.0, "nucleus sampling mass in (0, 1]; 1 keeps all", lo=0.0, hi=1.0)


@dataclass(frozen=True)
class LimitsSpec:
    max_batch: int = _f(8, "most rows generated together", lo=1, hi=1024)
    max_context: int | str = _f("model", "most tokens (prompt + generated) per row; model: the target's own context "
                                         "window (config max_position_embeddings, at most 131072)", lo=16, hi=131072,
                                also=("model",))


@dataclass(frozen=True)
class TensorRTSpec:
    workspace_mb: int = _f(4096, "builder memory pool limit (TensorRT workspace), MiB", lo=16, hi=1 << 20)
    optimization_level: int = _f(3, "TensorRT builder optimisation level: higher builds longer, may run faster", lo=0, hi=5)
    min_block_size: int = _f(5, "torch_tensorrt: fewest consecutive convertible ops put in a TensorRT engine", lo=1, hi=1 << 20)
    cuda_graphs: bool = _f(False, "tensorrt: replay fixed-shape draft and verify steps as CUDA graphs")


@dataclass(frozen=True)
class Recipe:
    target: TargetSpec = _f(TargetSpec(), "the model whose output distribution is kept exactly")
    draft: DraftSpec = _f(DraftSpec(), "the cheap proposer")
    speculation: SpeculationSpec = _f(SpeculationSpec(), "shape of each speculative round")
    sampling: SamplingSpec = _f(SamplingSpec(), "defaults for generate; requests may override")
    limits: LimitsSpec = _f(LimitsSpec(), "shape ranges the graphs are compiled for")
    backend: str = _f("onnxruntime", "engine the graphs are lowered to", choices=BACKENDS)
    precision: str = _f("fp32", "engine precision (fp16/bf16 for GPU backends)", choices=PRECISIONS)
    device: str = _f("cpu", "device the engines run on", choices=("cpu", "cuda"))
    tensorrt: TensorRTSpec = _f(TensorRTSpec(), "settings of the tensorrt and torch_tensorrt backends")
    output: str = _f("bundles/out", "bundle directory written by `specc compile` (relative to the current directory)")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _type_name(tp: Any) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false", list: "a list"}.get(tp, str(tp))


def _check_value(path: str, value: Any, tp: Any, meta: dict) -> Any:
    if isinstance(value, str) and value in meta.get("also", ()):
        return value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None and len(args) < len(typing.get_args(tp)):
            return None
        tp = args[0]
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    ok = isinstance(value, tp) and not (tp in (int, float) and isinstance(value, bool))
    if not ok:
        also = "".join(f" or {a!r}" for a in meta.get("also", ()))
        raise RecipeError(path, f"expected {_type_name(tp)}{also}, got {_short(value)}")
    if tp is float and not math.isfinite(value):
        raise RecipeError(path, f"expected a finite number, got {value!r}")
    if tp is str and ("\0" in value or len(value) > 4096):
        raise RecipeError(path, "expected a string without NUL characters, at most 4096 characters long")
    if meta.get("choices") and value not in meta["choices"]:
        raise RecipeError(path, f"{value!r} is not allowed; allowed: {', '.join(map(str, meta['choices']))}")
    if meta.get("lo") is not None and value < meta["lo"]:
        raise RecipeError(path, f"{value!r} is below the minimum {meta['lo']}")
    if meta.get("hi") is not None and value > meta["hi"]:
        raise RecipeError(path, f"{value!r} is above the maximum {meta['hi']}")
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _build(cls: type, data: Any, path: str) -> Any:
    if not isinstance(data, dict):
        raise RecipeError(path or "<root>", f"expected a mapping of fields, got {_short(data)}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names), key=str)
    if unknown:
        where = f"{path}.{unknown[0]}" if path else str(unknown[0])
        raise RecipeError(where, f"unknown field; allowed here: {', '.join(names)}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            sub = f"{path}.{f.name}" if path else f.name
            kwargs[f.name] = _check_value(sub, data[f.name], hints[f.name], dict(f.metadata))
    return cls(**kwargs)


def _check_consistency(r: Recipe) -> None:
    if not r.target.model:
        raise RecipeError("target.model", "required: a catalog name, Hugging Face model directory or .gguf file")
    d = r.draft
    _check_draft_fields(d)
    if d.quantize and r.backend != "onnxruntime":
        raise RecipeError("draft.quantize", f"quantised draft graphs need backend 'onnxruntime', not {r.backend!r}")
    if r.target.quantize and r.backend not in ("onnxruntime", "tensorrt"):
        raise RecipeError("target.quantize", _TARGET_QUANT_BACKENDS[r.backend])
    if r.target.quantize == "fp8" and r.backend != "tensorrt":
        raise RecipeError("target.quantize", "fp8 weights are for backend tensorrt; onnxruntime takes int8, int4, int8-gemm "
                                             "or int4-gemm")
    if r.target.quantize == "int4-gemm":
        if r.backend != "onnxruntime":
            raise RecipeError("target.quantize", "int4-gemm runs on specc's own ONNX Runtime kernels: backend onnxruntime "
                                                 "only (tensorrt takes int8, int4 or fp8)")
        for name, default in (("block_size", 32), ("accuracy_level", 4)):
            if getattr(r.target, name) != default:
                raise RecipeError(f"target.{name}", "does not apply to int4-gemm (blocks of 32, int8 activations)")
    if r.target.quantize == "int8-gemm":
        if r.backend != "onnxruntime":
            raise RecipeError("target.quantize", "int8-gemm runs on ONNX Runtime's integer GEMM: backend onnxruntime only "
                                                 "(tensorrt takes int8, int4 or fp8)")
        for name, default in (("block_size", 32), ("accuracy_level", 4), ("gguf_requantize", [])):
            if getattr(r.target, name) != default:
                raise RecipeError(f"target.{name}", "does not apply to int8-gemm (one scale per output channel, integer "
                                                    "compute; GGUF blocks are not kept)")
    if not r.target.quantize:
        for name, default in (("block_size", 32), ("accuracy_level", 4), ("keep_float", []), ("gguf_blocks", True),
                              ("gguf_requantize", [])):
            if getattr(r.target, name) != default:
                raise RecipeError(f"target.{name}", "only applies with target.quantize (int8, int4, int8-gemm or int4-gemm)")
    if any(not isinstance(p, str) or not p for p in r.target.keep_float):
        raise RecipeError("target.keep_float", f"expected module names or globs (strings), got {r.target.keep_float!r}")
    bad = [t for t in r.target.gguf_requantize if t not in GGUF_BLOCK_TYPES]
    if bad:
        raise RecipeError("target.gguf_requantize", f"{_short(bad[0])} is not a GGUF block type specc keeps; allowed: "
                          f"{', '.join(GGUF_BLOCK_TYPES)}")
    if r.target.gguf_requantize and not r.target.gguf_blocks:
        raise RecipeError("target.gguf_requantize", "only applies with target.gguf_blocks true (false requantises every layer)")
    _check_draft(r)
    method = get_method(d.method)
    if r.sampling.top_p <= 0:
        raise RecipeError("sampling.top_p", f"{r.sampling.top_p!r} keeps no token; allowed: (0, 1], 1 keeps all")
    if d.min_ngram > d.max_ngram:
        raise RecipeError("draft.min_ngram", f"{d.min_ngram} is above draft.max_ngram ({d.max_ngram})")
    if r.device == "cuda" and r.backend == "onnxruntime":
        raise RecipeError("device", "backend 'onnxruntime' runs on cpu in specc; "
                                    "use tensorrt, torch_tensorrt, aoti or torch for cuda")
    if r.backend in ("tensorrt", "torch_tensorrt") and r.device != "cuda":
        raise RecipeError("device", f"backend {r.backend!r} needs device 'cuda'")
    if r.precision != "fp32" and r.device == "cpu":
        raise RecipeError("precision", f"{r.precision!r} is for GPU backends; on cpu use fp32")
    if r.precision != "fp32" and r.backend not in ("tensorrt", "torch_tensorrt"):
        raise RecipeError("precision", f"backend {r.backend!r} runs the graph in the traced dtype; "
                          f"set target.dtype (float16, bfloat16) instead of precision {r.precision!r}")
    if r.speculation.verify_head and (r.speculation.mode == "tree" or method.drafter is None):
        raise RecipeError("speculation.verify_head",
                          "the verification head accepts chains; use it with speculation.mode chain and a draft")
    if r.speculation.mode == "tree":
        if not method.trees:
            raise RecipeError("speculation.mode", f"tree speculation needs a drafter of token trees (draft.method "
                              f"{', '.join(methods_with(trees=True))}), not {d.method!r}")
        try:
            TreeShape.from_recipe(dataclasses.asdict(r.speculation.tree))
        except ValueError as exc:
            field = "verify_nodes" if "verify_nodes" in str(exc) else "paths"
            raise RecipeError(f"speculation.tree.{field}", str(exc)) from None


def _check_draft(r: Recipe) -> None:
    """The draft section against the method's row (specc/methods.py) and the speculation mode."""
    d = r.draft
    method = get_method(d.method)
    if d.lookup and (not method.lookup_in_front or method.tree_only):  # lookup drafts chains
        raise RecipeError("draft.lookup", f"adds prompt lookup in front of a draft model or head (draft.method "
                          f"{', '.join(methods_with(lookup_in_front=True, tree_only=False))}), not {d.method!r}")
    if d.lookup and r.speculation.mode != "chain":
        raise RecipeError("draft.lookup", "prompt lookup proposes chains; use it with speculation.mode chain")
    if d.suffix and set(SUFFIX_SETTINGS) <= set(method.settings):
        raise RecipeError("draft.suffix", "puts the suffix drafter in front of a draft model or head; with draft.method "
                          f"{d.method} it already is the drafter: leave draft.suffix out")
    if d.suffix and not method.lookup_in_front:
        raise RecipeError("draft.suffix", f"adds the suffix drafter in front of a draft model or head (draft.method "
                          f"{', '.join(methods_with(lookup_in_front=True))}), not {d.method!r}")
    if d.suffix and d.lookup:
        raise RecipeError("draft.suffix", "cannot be combined with draft.lookup: both draft from the request's context; "
                          "choose one (suffix also drafts from earlier requests' outputs)")
    _check_method_settings(d, method)
    _check_lookahead(r)
    if d.stop_below and not method.stops:
        raise RecipeError("draft.stop_below", f"ends chains drafted one token at a time (draft.method "
                          f"{', '.join(methods_with(stops=True))}), not {d.method!r}")
    if d.stop_below and r.speculation.mode != "chain":
        raise RecipeError("draft.stop_below", "applies to chains; trees already grow by draft confidence (speculation.tree)")


def _check_method_settings(d: DraftSpec, method: DraftMethod) -> None:
    """Draft fields of one method (its row's `settings`) are refused under another, but for the suffix
    drafter's under draft.suffix: true."""
    mine = set(method.settings) | (set(SUFFIX_SETTINGS) if d.suffix else set())
    for other in METHODS.values():
        for name in set(other.settings) - mine:
            if getattr(d, name) != DraftSpec.__dataclass_fields__[name].default:
                users = [m.name for m in METHODS.values() if name in m.settings]
                extra = " or draft.suffix: true" if name in SUFFIX_SETTINGS else ""
                raise RecipeError(f"draft.{name}", f"only applies with draft.method {' or '.join(users)}{extra}")


def _check_lookahead(r: Recipe) -> None:
    """A method that lays out its own tree (lookahead): a tree mode recipe whose draft fields shape the tree."""
    d = r.draft
    method = get_method(d.method)
    if not method.tree_only:
        return
    if r.speculation.mode != "tree":
        raise RecipeError("speculation.mode", f"draft.method {d.method} verifies its lookahead and verification "
                          "branches as one token tree: set speculation.mode tree")
    if r.speculation.tree != TreeSpec():
        raise RecipeError("speculation.tree", f"does not apply to draft.method {d.method}: draft."
                          f"{', draft.'.join(method.settings)} shape its tree")
    nodes, _ = method.own_tree(d)
    if nodes > MAX_TREE_NODES:
        raise RecipeError("draft.window", f"(window + verify_ngrams) x (ngram - 1) - 1 = {nodes} nodes a round; at most "
                          f"{MAX_TREE_NODES}: lower window, verify_ngrams or ngram")


def tree_nodes(r: Recipe) -> int:
    """Most drafted nodes a tree round of this recipe verifies (the compiled graphs' step size)."""
    method = get_method(r.draft.method)
    return method.own_tree(r.draft)[0] if method.own_tree else r.speculation.tree.max_nodes


def _check_draft_fields(d: DraftSpec) -> None:
    """Each method's own draft fields (specc/methods.py): the ones it requires are set, no other method's is."""
    method = get_method(d.method)
    for name in METHOD_FIELDS:
        value = getattr(d, name)
        if name in method.requires and value is None:
            raise RecipeError(f"draft.{name}", f"required when draft.method is {d.method!r}" + _FIELD_HINTS.get(name, ""))
        if value is not None and name not in method.fields:
            users = [repr(m) for m in methods_with() if name in METHODS[m].fields]
            users = f"{', '.join(users[:-1])} or {users[-1]}" if len(users) > 1 else users[0]
            raise RecipeError(f"draft.{name}", f"only used with draft.method {users}, not {d.method!r}")


_FIELD_HINTS = {
    "quantize": " (allowed: int8, int4)",
    "head": ": a directory from `specc train-head` or a published Medusa / EAGLE head",
}


_TARGET_QUANT_BACKENDS = {
    "torch": "backend 'torch' runs the traced dtype and has no weight-only int8/int4 kernels in specc; "
             "use backend onnxruntime (MatMulNBits) or target.dtype float16/bfloat16",
    "aoti": "backend 'aoti' runs the traced dtype and has no weight-only int8/int4 kernels in specc; "
            "use backend onnxruntime (MatMulNBits) or target.dtype float16/bfloat16",
    "torch_tensorrt": "backend 'torch_tensorrt' has no weight-only int8/int4 route in specc; use backend onnxruntime",
}


def parse_recipe(data: Any, source: str = "<recipe>") -> Recipe:
    """Validate a recipe mapping; raises RecipeError naming the field and what is allowed."""
    if data is None:
        raise RecipeError("<root>", f"{source} is empty; it needs at least target.model")
    recipe = _build(Recipe, data, "")
    _check_consistency(recipe)
    return recipe


def load_recipe(path: str | Path) -> Recipe:
    """Read and validate a recipe YAML file; relative paths in it are resolved against its folder."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError("<file>", f"{path} does not exist or is not a file")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecipeError("<file>", f"{path} is not UTF-8 text (byte {exc.start}); a recipe is a YAML file") from None
    except OSError as exc:
        raise RecipeError("<file>", f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise RecipeError("<file>", f"{path} is not valid YAML: {exc}") from None
    except RecursionError:
        raise RecipeError("<file>", f"{path} nests too deeply to be a recipe") from None
    recipe = parse_recipe(data, str(path))
    return resolve_paths(recipe, path.parent)


def _resolve(value: str | None, base: Path) -> str | None:
    """Make a path-like value absolute against base; catalog names stay as they are."""
    if value is None:
        return None
    candidate = base / value
    if not Path(value).is_absolute() and (candidate.exists() or "/" in value or value.endswith(".gguf")):
        return str(candidate.resolve())
    return value


def resolve_paths(recipe: Recipe, base: Path) -> Recipe:
    """Return the recipe with model and adapter paths made absolute against base."""
    target = dataclasses.replace(recipe.target, model=_resolve(recipe.target.model, base))
    draft = dataclasses.replace(recipe.draft, model=_resolve(recipe.draft.model, base),
                                adapter=_resolve(recipe.draft.adapter, base),
                                head=_resolve(recipe.draft.head, base))
    return dataclasses.replace(recipe, target=target, draft=draft)


def describe_schema(cls: type = Recipe, prefix: str = "") -> list[str]:
    """One line per recipe field: path, default, allowed values and help; for `specc compile --help`."""
    lines = []
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        tp = typing.get_type_hints(cls)[f.name]
        meta = f.metadata
        if dataclasses.is_dataclass(tp):
            lines.append(f"  {path}: {meta['help']}")
            lines.extend(describe_schema(tp, path + "."))
            continue
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        # a field typed without None whose default is None has no usable default: the recipe must set it
        required = default is None and type(None) not in typing.get_args(tp)
        shown = "required" if required else f"default {default!r}"
        allowed = list(map(str, meta.get("choices") or ()))
        if meta.get("lo") is not None or meta.get("hi") is not None:
            allowed.append(f"{'' if meta.get('lo') is None else meta['lo']}..{'' if meta.get('hi') is None else meta['hi']}")
        allowed += map(str, meta.get("also") or ())
        values = f" [{'|'.join(allowed)}]" if allowed else ""
        lines.append(f"  {path} ({shown}){values}: {meta['help']}")
    return lines
