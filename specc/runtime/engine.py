"""The Engine: what the scheduler runs rounds with, and all it may see of a loaded bundle.

The target and its verifier, the drafter, the caches that outlive a request (the prefix cache; the
suffix cache lives in the drafter), the policies that calls learn and later calls reuse, and the limits
of the bundle. Requests, tokenizers and sampling defaults are the model API's (runtime/model.py).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import torch

from ..backends import Runner
from ..bundle import Bundle
from ..errors import RequestError, escape_control
from ..methods import get_method
from ..speculation.tree import TreeShape
from .drafters import DraftContext, build_drafter
from .graphs import load_graph, min_target_pass_rows, open_runner
from .host_threads import host_threads
from .prefix_cache import PrefixCache, default_budget_mb
from .step import DEFAULT_CHUNK, StepRunner
from .target import Target
from .verifier import Verifier


class Engine:
    """A bundle's graphs, drafter, caches and learned policies; `Scheduler(engine)` runs rounds with them."""

    def __init__(self, bundle: Bundle, open_graph: Callable[[Bundle, str], Runner] | None = None):
        """open_graph(bundle, role) opens one graph's engine; by default `open_runner`, the bundle's
        backend in this process (specc.triton passes one that calls engines served by Triton)."""
        self.bundle = bundle
        m = bundle.manifest
        recipe = m.recipe
        self.device = torch.device(recipe.device)
        self.host_threads = host_threads(m.backend, recipe.device)  # torch's threads while rounds run
        self._open_graph = open_graph or open_runner
        self.max_batch = recipe.limits.max_batch
        self.max_context = recipe.limits.max_context
        self.k = recipe.speculation.k
        self.stop_below = recipe.draft.stop_below  # a row's chain ends after a draft below this probability
        self.eos_ids = set(m.tokenizer.eos_token_ids)
        self.min_pass_rows = min_target_pass_rows(bundle)  # the target's 1-token passes are padded to this many rows
        self.target = Target(self._load_graph("target", self.min_pass_rows or 1), bundle.graph("target").outputs)
        self.draft_method = m.draft.method
        self.verifier = Verifier(self.target)
        self.drafter = build_drafter(self.draft_method, DraftContext(
            dataclasses.asdict(recipe.draft), m.draft.graph, self._load_graph, self.max_context,
            self.target.dims.vocab_size))
        self.tree = _tree_shape(recipe) if recipe.speculation.mode == "tree" else None
        if self.min_pass_rows is None and self.drafter is not None:
            logging.getLogger("specc").warning(
                "bundle %s: on this CPU its quantised target computes a row differently in passes of different sizes, "
                "so greedy speculative output can differ from its target-only output where two tokens nearly tie "
                "(sampled output still follows the verify pass's distribution). docs/quantization.md lists the "
                "settings that are row-invariant on which CPUs", escape_control(bundle.path))
        self.prefill_chunk = DEFAULT_CHUNK
        self.interleave_chunk = DEFAULT_CHUNK  # most prompt tokens per step while other rows decode (runtime/pacing.py)
        self.prefix_cache = PrefixCache(default_budget_mb() << 20)  # shared by every call and server request
        self.policies: dict[tuple, object] = {}  # learned policies (k auto, the lookahead gate) by their settings

    def _load_graph(self, role: str, min_rows: int = 1) -> StepRunner:
        return load_graph(self.bundle, role, self._open_graph, self.device, min_rows)

    @property
    def prefill_chunk(self) -> int:
        """Most prompt tokens per row in one prefill pass, the target's and the draft's (runtime/prefill.py)."""
        return self._prefill_chunk

    @prefill_chunk.setter
    def prefill_chunk(self, tokens: int) -> None:
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
            raise RequestError(f"prefill_chunk must be an integer >= 1, got {tokens!r}")
        self._prefill_chunk = tokens
        if self.drafter is not None:
            self.drafter.set_prefill_chunk(tokens)

    def set_prefix_cache_mb(self, mb: int) -> None:
        """Keep at most `mb` MiB of target KV in the prefix cache (0: off); what it held is dropped."""
        self.prefix_cache = PrefixCache(int(mb) << 20)

    def policy(self, key: tuple, make: Callable[[], object]) -> object:
        """The learned policy of these settings: made on first use, then shared by every later call."""
        if key not in self.policies:
            self.policies[key] = make()
        return self.policies[key]

    @property
    def verify_head(self) -> bool:
        """Acceptance runs inside the target graph (passes/insert_verify_head.py)."""
        return self.target.verify_head

    @property
    def can_speculate(self) -> bool:
        return self.drafter is not None

    @property
    def front_drafter(self) -> str | None:
        """The drafter in front of the draft model, in words: "prompt lookup" (draft.lookup), "suffix" (draft.suffix)."""
        front = self.drafter.front if self.drafter is not None else None
        return front.method.name.replace("_", " ") if front is not None else None

    @property
    def draft_label(self) -> str:
        """The draft method as tables name it: 'quantized+lookup' for prompt lookup in front of a quantised target,
        'model+suffix' for the suffix drafter in front of a draft model."""
        return self.drafter.label if self.drafter is not None else self.draft_method

    @property
    def suffix_cache(self):
        """The global suffix cache (outputs of earlier requests) this engine drafts from, or None (draft.method
        suffix, or draft.suffix: true; runtime/drafters/suffix.py). It lives as long as the engine, so a server
        keeps it across requests."""
        return self.drafter.suffix_cache if self.drafter is not None else None


def _tree_shape(recipe) -> TreeShape:
    """The recipe's tree shape; a method that lays out its own tree (lookahead) gives only its node count, which
    sizes the round's noise, and a name from its settings."""
    method = get_method(recipe.draft.method)
    if method.own_tree is not None:
        nodes, name = method.own_tree(recipe.draft)
        return TreeShape(None, depth=1, branching=1, max_nodes=nodes, name=name)
    return TreeShape.from_recipe(dataclasses.asdict(recipe.speculation.tree))
