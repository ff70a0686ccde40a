"""The draft methods, one row each: what every method can do, declared once.

The recipe's checks, the compiler (which draft graph to build), the pass pipeline (which passes
each graph gets) and the runtime (which drafter runs a bundle) all read this table, in the
spirit of TensorRT-LLM's `SpeculativeDecodingMode`. Adding a drafter is a module with its
`Drafter` subclass and one `register_method` line here (or in the code that defines it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .limits import lookahead_nodes

# What the bundle's draft graph is, by the draft method's `graph`:
#   "model"  a separate draft model, traced (recipe draft.model)
#   "target" the target itself, traced again or its exported program reused (quantised self-draft)
#   "exit"   the target's first draft.layer layers with an exit head (passes add_early_exit, truncate_to_exit)
#   "head"   a learned head over the target's features (Medusa, EAGLE; heads/graph.py)
#   None     no draft graph (prompt lookup, suffix decoding, lookahead decoding, or no drafting)
GRAPH_KINDS = ("model", "target", "exit", "head", None)

# Draft fields that belong to some methods only; the rest (lookup, n-grams, stop_below) are capabilities below.
METHOD_FIELDS = ("model", "quantize", "layer", "adapter", "head")


@dataclass(frozen=True)
class DraftMethod:
    """One way of drafting and what it can do.

    drafter: the runtime class that drafts for it, as "module:Class" (imported when a bundle loads, so this
    table stays below the runtime in the layers) or the class itself; None for no drafting. The rest is what
    the recipe checks, the compiler, the scheduler, `specc tune` and the CLI read about the method."""

    name: str
    graph: str | None  # GRAPH_KINDS
    drafter: str | type | None
    fields: tuple[str, ...] = ()  # METHOD_FIELDS this method uses
    requires: tuple[str, ...] = ()  # of those, the ones the recipe must set
    reads_features: bool = False  # the target graph also returns the hidden states the drafter reads
    draft_attends: bool = True  # the draft graph attends over tokens (a tree mask pass applies to it)
    trees: bool = False  # drafts token trees (speculation.mode tree)
    tree_only: bool = False  # drafts nothing but token trees: its recipe needs speculation.mode tree
    own_tree: Callable | None = None  # a tree_only method lays out its own tree: (its nodes, its name) from draft settings
    sized_trees: bool = False  # its node scores estimate acceptance: rounds verify as many nodes as pay (TreeSizer)
    stops: bool = False  # drafts one token at a time and can end a chain early (draft.stop_below)
    ngram_lookup: bool = False  # drafts what followed an earlier occurrence of the context's last n-gram (draft.max_ngram)
    lookup_in_front: bool = False  # prompt lookup or the suffix drafter may draft first (draft.lookup, draft.suffix)
    front: str | None = None  # its name where it drafts in front of another method (an arm, a label's suffix)
    shares_target_cache: bool = False  # the draft graph reads the target's KV cache
    own_cache: bool = False  # the draft graph keeps a KV cache of its own, as large as its model's
    lazy_prefill: bool = False  # it takes a row's context in when it first drafts for it (its own cache fills late)
    prompt_features: bool = False  # prefill hands it the target's features of every prompt token (no prefix cache)
    cost: str = "step"  # how tune times one unit of its drafting: "step" (a draft graph call) or "lookup" (a search)
    settings: tuple[str, ...] = ()  # draft fields of its own besides METHOD_FIELDS (recipe: refused for other methods)

    def __post_init__(self) -> None:
        if self.graph not in GRAPH_KINDS:
            raise ValueError(f"draft method {self.name!r}: graph {self.graph!r} is not one of {GRAPH_KINDS}")
        unknown = set(self.fields) - set(METHOD_FIELDS) or set(self.requires) - set(self.fields)
        if unknown:
            raise ValueError(f"draft method {self.name!r}: fields {sorted(unknown)} are not its own draft fields")


METHODS: dict[str, DraftMethod] = {}


def register_method(method: DraftMethod) -> DraftMethod:
    """Add (or replace) a row of the table."""
    METHODS[method.name] = method
    return method


def get_method(name: str) -> DraftMethod:
    """The row of a draft method; KeyError names the known ones."""
    try:
        return METHODS[name]
    except KeyError:
        raise KeyError(f"draft method {name!r} is not known; known: {', '.join(METHODS)}") from None


def methods_with(**capabilities: object) -> tuple[str, ...]:
    """Names of the methods whose capabilities equal these (e.g. stops=True), in table order."""
    return tuple(m.name for m in METHODS.values() if all(getattr(m, k) == v for k, v in capabilities.items()))


def _lookahead_tree(d) -> tuple[int, str]:
    return lookahead_nodes(d.window, d.ngram, d.verify_ngrams), f"lookahead W{d.window} N{d.ngram} G{d.verify_ngrams}"


_RUNTIME = "specc.runtime.drafters"
SUFFIX_SETTINGS = ("suffix_requests", "suffix_tokens")  # also the suffix drafter's in front of a model (draft.suffix)
LOOKAHEAD_SETTINGS = ("window", "ngram", "verify_ngrams")
for _method in (
    DraftMethod("model", "model", f"{_RUNTIME}.model:ModelDrafter", fields=("model", "quantize"), requires=("model",),
                trees=True, stops=True, lookup_in_front=True, own_cache=True, lazy_prefill=True, settings=("vocab",)),
    DraftMethod("quantized", "target", f"{_RUNTIME}.model:ModelDrafter", fields=("quantize",), requires=("quantize",),
                trees=True, stops=True, lookup_in_front=True, own_cache=True, lazy_prefill=True),
    DraftMethod("early_exit", "exit", f"{_RUNTIME}.model:SharedCacheDrafter", fields=("layer", "adapter"),
                requires=("layer",), trees=True, stops=True, lookup_in_front=True, shares_target_cache=True),
    DraftMethod("prompt_lookup", None, f"{_RUNTIME}.lookup:PromptLookupDrafter", ngram_lookup=True, front="lookup",
                cost="lookup"),
    DraftMethod("suffix", None, f"{_RUNTIME}.suffix:SuffixDrafter", trees=True, sized_trees=True, front="suffix",
                cost="lookup", settings=SUFFIX_SETTINGS),
    DraftMethod("lookahead", None, f"{_RUNTIME}.lookahead:LookaheadDrafter", trees=True, tree_only=True,
                own_tree=_lookahead_tree, lookup_in_front=True,
                settings=LOOKAHEAD_SETTINGS),
    DraftMethod("medusa", "head", f"{_RUNTIME}.heads:MedusaDrafter", fields=("quantize", "head"), requires=("head",),
                reads_features=True, draft_attends=False, trees=True),
    DraftMethod("eagle", "head", f"{_RUNTIME}.heads:EagleDrafter", fields=("quantize", "head"), requires=("head",),
                reads_features=True, trees=True, stops=True, lookup_in_front=True, prompt_features=True),
    DraftMethod("none", None, None),
):
    register_method(_method)
