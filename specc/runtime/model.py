"""SpecModel: a loaded bundle that generates text with speculative rounds (runtime/scheduler.py)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence as Seq

import torch

from ..backends import LowerOptions, Runner, get_backend
from ..bundle import Bundle, open_bundle
from ..capture.shapes import ModelDims
from ..errors import BundleError, RequestError
from ..speculation.sampling import SamplingParams
from ..speculation.tree import TreeShape
from .drafters import DraftContext, build_drafter
from .scheduler import Scheduler, StreamEvent
from .state import Request
from .stats import RunStats
from .step import StepRunner
from .target import Target
from .text import TextStream


@dataclass
class Completion:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: dict


class SpecModel:
    """Generate with a compiled bundle: `specc.load(path).generate(["prompt"])`."""

    def __init__(self, bundle: Bundle, open_graph: Callable[[Bundle, str], Runner] | None = None):
        """open_graph(bundle, role) opens one graph's engine; by default `open_runner`, the bundle's
        backend in this process (specc.triton passes one that calls engines served by Triton)."""
        self.bundle = bundle
        m = bundle.manifest
        recipe = m["recipe"]
        self.device = torch.device(recipe.get("device", "cpu"))
        self._open_graph = open_graph or open_runner
        self.max_batch = recipe["limits"]["max_batch"]
        self.max_context = recipe["limits"]["max_context"]
        self.k = recipe["speculation"]["k"]
        spec = recipe["speculation"]
        self.tree = TreeShape.from_recipe(spec["tree"]) if spec["mode"] == "tree" else None
        self.defaults = SamplingParams(**recipe["sampling"])
        self.eos_ids = set(m["tokenizer"]["eos_token_ids"])
        self.target = Target(self._load_graph("target"), self.bundle.graph("target")["outputs"])
        self.draft_method = m["draft"]["method"]
        self.drafter = build_drafter(self.draft_method, DraftContext(
            recipe["draft"], m["draft"].get("graph"), bool(m["draft"].get("shares_target_cache")), self._load_graph,
            self.max_context, self.target.dims.vocab_size))
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(bundle.path / m["tokenizer"]["dir"])
        self.last_stats = RunStats()

    def _load_graph(self, role: str) -> StepRunner:
        entry = self.bundle.graph(role)
        if entry is None:
            raise BundleError(f"bundle {self.bundle.path} has no {role!r} graph")
        return StepRunner(self._open_graph(self.bundle, role), ModelDims(**entry["model"]), self.device,
                          [i["name"] for i in entry["inputs"]])

    @property
    def verify_head(self) -> bool:
        """Acceptance runs inside the target graph (passes/insert_verify_head.py)."""
        return self.target.verify_head

    @property
    def can_speculate(self) -> bool:
        return self.drafter is not None

    @property
    def lookup_first(self) -> bool:
        """Prompt lookup drafts first, the draft model where it finds nothing (recipe draft.lookup)."""
        return self.drafter is not None and self.drafter.lookup_first

    @property
    def draft_label(self) -> str:
        """The draft method as tables name it: 'quantized+lookup' for a lookup-first drafter."""
        return self.draft_method + ("+lookup" if self.lookup_first else "")

    # -- public API -------------------------------------------------------------------
    def generate(self, prompts: str | Seq[str] | Seq[Seq[int]], **kwargs) -> list[Completion]:
        """Generate for every prompt; keyword arguments as in `stream`."""
        single = isinstance(prompts, str)
        collected: dict[int, list] = {}
        stats: dict[int, dict] = {}
        for ev in self.stream([prompts] if single else prompts, **kwargs):
            text, ids, reason = collected.setdefault(ev.index, ["", [], None])
            collected[ev.index] = [text + ev.text, ids + ev.token_ids, ev.finish_reason or reason]
            if ev.stats is not None:
                stats[ev.index] = ev.stats
        return [Completion(i, *collected[i], stats=stats[i]) for i in sorted(collected)]

    def stream(self, prompts: Seq[str] | Seq[Seq[int]], *, max_new_tokens: int = 64,
               temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
               seed: int | Seq[int] = 0, stop: Seq[str] = (), speculative: bool = True, k: int | None = None,
               tree: TreeShape | None = None, chat: bool = False) -> Iterator[StreamEvent]:
        """Yield text as rounds complete; at most max_batch rows run at once, the rest join as rows finish.

        prompts: strings (or token-id lists); chat applies the tokenizer's chat template.
        seed: one int (row i uses seed + i) or one per prompt. speculative=False runs the
        same compiled target without drafting (the in-run baseline). k asks for chain
        speculation of that length, tree for that token tree (bundles compiled for trees);
        neither: the recipe's speculation.
        """
        params = self.sampling_params(temperature, top_k, top_p)
        encoded = self.encode(prompts, chat)
        seeds = _seeds(seed, len(encoded))
        scheduler = Scheduler(self, speculative=speculative, k=k, tree=tree)
        for i, ids in enumerate(encoded):
            scheduler.submit(self.new_request(i, ids, max_new_tokens, params, seeds[i], stop, k=scheduler.lookahead))
        self.last_stats = scheduler.stats
        while scheduler.busy:
            yield from scheduler.step()

    # -- requests ---------------------------------------------------------------------
    def sampling_params(self, temperature=None, top_k=None, top_p=None) -> SamplingParams:
        """Request settings over the recipe's defaults, validated."""
        return SamplingParams(
            self.defaults.temperature if temperature is None else temperature,
            self.defaults.top_k if top_k is None else top_k,
            self.defaults.top_p if top_p is None else top_p,
        ).validate()

    def new_request(self, index: int, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams,
                    seed: int, stop: Seq[str] = (), k: int = 0) -> Request:
        """A validated request, ready for `Scheduler.submit`; k: tokens drafted per round (Scheduler.lookahead)."""
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if isinstance(stop, str) or not all(isinstance(s, str) and s for s in stop):
            raise RequestError(f"stop must be a list of non-empty strings, got {stop!r}")
        need = len(prompt_ids) + max_new_tokens + k + 1
        if need > self.max_context:
            raise RequestError(
                f"prompt of {len(prompt_ids)} tokens + max_new_tokens {max_new_tokens} + speculation {k + 1} = {need} tokens, "
                f"above this bundle's max_context {self.max_context}; shorten the prompt or max_new_tokens, "
                "or compile with a larger limits.max_context"
            )
        return Request(index, list(prompt_ids), max_new_tokens, params, torch.Generator().manual_seed(seed),
                       TextStream(self.tokenizer, tuple(stop)))

    def encode(self, prompts, chat: bool = False) -> list[list[int]]:
        """Token ids of each prompt (strings, or token-id lists checked against the vocabulary)."""
        if isinstance(prompts, str) or not isinstance(prompts, Seq) or len(prompts) == 0:
            raise RequestError("prompts must be a non-empty list of strings (or of token-id lists)")
        vocab = self.target.dims.vocab_size
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                if not p:
                    raise RequestError(f"prompt {i} is empty; give at least one character")
                if chat:
                    ids = self.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                             tokenize=True, return_dict=False)
                else:
                    ids = self.tokenizer(p, add_special_tokens=True)["input_ids"]
            elif isinstance(p, Seq) and p and all(isinstance(t, int) for t in p):
                ids = list(p)
                bad = [t for t in ids if not 0 <= t < vocab]
                if bad:
                    raise RequestError(f"prompt {i} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
            else:
                raise RequestError(f"prompt {i} must be a non-empty string or list of token ids, got {type(p).__name__}")
            if not ids:
                raise RequestError(f"prompt {i} encodes to no tokens")
            out.append(list(ids))
        return out


def _seeds(seed, n: int) -> list[int]:
    if isinstance(seed, int) and not isinstance(seed, bool):
        return [seed + i for i in range(n)]
    seeds = list(seed) if isinstance(seed, Seq) else []
    if len(seeds) != n or not all(isinstance(s, int) for s in seeds):
        raise RequestError(f"seed must be one int or one int per prompt ({n}), got {seed!r}")
    return seeds


def open_runner(bundle: Bundle, role: str) -> Runner:
    """Open one graph of a bundle with the bundle's backend, in this process (versions checked)."""
    backend = get_backend(bundle.manifest["backend"])
    backend.check_versions(bundle.manifest["versions"])
    entry = bundle.graph(role)
    recipe = bundle.recipe
    options = LowerOptions(recipe["precision"], recipe.get("device", "cpu"), entry.get("quantize"))
    return backend.load(bundle.path / entry["dir"], entry, options)


def load(path: str | Path, verify: bool = True) -> SpecModel:
    """Open a bundle (checking every file's sha256 unless verify=False) and load its engines."""
    return SpecModel(open_bundle(path, verify=verify))
