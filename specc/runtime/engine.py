"""SpecModel: a loaded bundle that generates text with speculative rounds.

One round (chain):  draft k tokens → verify k+1 on the target → accept → commit.
A Scheduler runs rounds over a batch that requests join and leave between rounds.
"""
from __future__ import annotations

import dataclasses
import numbers
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence as Seq

import torch

from ..backends import LowerOptions, Runner, get_backend
from ..bundle import Bundle, check_code_trust, open_bundle
from ..capture.export import ModelDims
from ..errors import BundleError, RequestError, SpeccError
from .drafters import LookupFirstDrafter, ModelDrafter, PromptLookupDrafter, SharedCacheDrafter
from .kv_cache import KVCache
from .sampling import SamplingParams, accept, choose, probs_from_logits
from .state import Batch, RowStats, Sequence
from .step import StepRunner, pad_right
from .text import TextStream
from .tree import TreeShape, accept_tree_greedy, accept_tree_sampled, tree_tensors


@dataclass
class StreamEvent:
    index: int  # which request
    text: str  # newly released text
    token_ids: list[int]  # newly generated tokens
    finished: bool = False
    finish_reason: str | None = None  # "stop" (EOS or stop string) or "length"
    stats: dict | None = None  # the request's speculation stats, on its last event


@dataclass
class Completion:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: dict


@dataclass
class RunStats:
    """Aggregate figures of one generate call (or one scheduler's life)."""

    requests: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0  # drafting, including the draft's own sampling
    target_seconds: float = 0.0  # target passes after prefill (verify, or decode without speculation)
    speculation: RowStats = field(default_factory=RowStats)

    def merge(self, other: "RunStats") -> None:
        for name in ("requests", "new_tokens", "seconds", "prefill_seconds", "draft_seconds", "target_seconds"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.speculation.merge(other.speculation)

    def to_dict(self) -> dict:
        host = self.seconds - self.draft_seconds - self.target_seconds - self.prefill_seconds
        return {
            "requests": self.requests,
            "new_tokens": self.new_tokens,
            "seconds": self.seconds,
            "tokens_per_second": self.new_tokens / self.seconds if self.seconds else None,
            "prefill_seconds": self.prefill_seconds,
            "draft_seconds": self.draft_seconds,
            "target_seconds": self.target_seconds,
            "host_seconds": host,
            **self.speculation.to_dict(),
        }


class SpecModel:
    """Generate with a compiled bundle: `specc.load(path).generate(["prompt"])`."""

    def __init__(self, bundle: Bundle, open_graph: Callable[[Bundle, str], Runner] | None = None):
        """open_graph(bundle, role) opens one graph's engine; by default `open_runner`, the bundle's
        backend in this process (specc.triton passes one that calls engines served by Triton)."""
        self.bundle = bundle
        m = bundle.manifest
        recipe = m.recipe
        self.device = torch.device(recipe.device)
        self._open_graph = open_graph or open_runner
        self.max_batch = recipe.limits.max_batch
        self.max_context = recipe.limits.max_context
        self.k = recipe.speculation.k
        spec = recipe.speculation
        self.tree = TreeShape.from_recipe(dataclasses.asdict(spec.tree)) if spec.mode == "tree" else None
        self.defaults = SamplingParams(recipe.sampling.temperature, recipe.sampling.top_k, recipe.sampling.top_p)
        self.eos_ids = set(m.tokenizer.eos_token_ids)
        self.target = self._load_graph("target")
        self.verify_head = "n_accepted" in self.bundle.graph("target").outputs
        self.draft_method = m.draft.method
        self.drafter = None
        lookup = PromptLookupDrafter(recipe.draft.max_ngram, recipe.draft.min_ngram, self.target.dims.vocab_size)
        if m.draft.graph:
            kind = SharedCacheDrafter if m.draft.shares_target_cache else ModelDrafter
            self.drafter = kind(self._load_graph(m.draft.graph), self.max_context)
            if recipe.draft.lookup:
                self.drafter = LookupFirstDrafter(lookup, self.drafter)
        elif self.draft_method == "prompt_lookup":
            self.drafter = lookup
        self.tokenizer = load_tokenizer(bundle)
        self.last_stats = RunStats()  # the most recent call's figures only; each call returns its own

    def _load_graph(self, role: str) -> StepRunner:
        entry = self.bundle.graph(role)
        if entry is None:
            raise BundleError(f"bundle {self.bundle.path} has no {role!r} graph")
        return StepRunner(self._open_graph(self.bundle, role), ModelDims(**entry.model), self.device,
                          [i.name for i in entry.inputs])

    @property
    def can_speculate(self) -> bool:
        return self.drafter is not None

    @property
    def lookup_first(self) -> bool:
        """Prompt lookup drafts first, the draft model where it finds nothing (recipe draft.lookup)."""
        return isinstance(self.drafter, LookupFirstDrafter)

    @property
    def draft_label(self) -> str:
        """The draft method as tables name it: 'quantized+lookup' for a lookup-first drafter."""
        return self.draft_method + ("+lookup" if self.lookup_first else "")

    # -- public API -------------------------------------------------------------------
    def generate(self, prompts: str | Seq[str] | Seq[Seq[int]], **kwargs) -> "Completions":
        """Generate for every prompt; keyword arguments as in `stream`. The result is a list of
        Completion (each with its request's stats) whose `.stats` are this call's RunStats."""
        single = isinstance(prompts, str)
        collected: dict[int, list] = {}
        stats: dict[int, dict] = {}
        run = RunStats()
        for ev in self.stream([prompts] if single else prompts, run_stats=run, **kwargs):
            text, ids, reason = collected.setdefault(ev.index, ["", [], None])
            collected[ev.index] = [text + ev.text, ids + ev.token_ids, ev.finish_reason or reason]
            if ev.stats is not None:
                stats[ev.index] = ev.stats
        return Completions([Completion(i, *collected[i], stats=stats[i]) for i in sorted(collected)], run)

    def stream(self, prompts: Seq[str] | Seq[Seq[int]], *, max_new_tokens: int = 64,
               temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
               seed: int | Seq[int] = 0, stop: Seq[str] = (), speculative: bool = True, k: int | None = None,
               tree: TreeShape | None = None, chat: bool = False,
               run_stats: RunStats | None = None) -> Iterator[StreamEvent]:
        """Yield text as rounds complete; at most max_batch rows run at once, the rest join as rows finish.

        prompts: strings (or token-id lists); chat applies the tokenizer's chat template.
        seed: one int (row i uses seed + i) or one per prompt. speculative=False runs the
        same compiled target without drafting (the in-run baseline). k asks for chain
        speculation of that length, tree for that token tree (bundles compiled for trees);
        neither: the recipe's speculation. run_stats: a RunStats this call fills (its own figures,
        safe under concurrent calls); `last_stats` is whichever call started last.
        """
        params = self.sampling_params(temperature, top_k, top_p)
        encoded = self.encode(prompts, chat)
        seeds = _seeds(seed, len(encoded))
        scheduler = Scheduler(self, speculative=speculative, k=k, tree=tree)
        if run_stats is not None:
            scheduler.stats = run_stats
        for i, ids in enumerate(encoded):
            scheduler.submit(self.new_sequence(i, ids, max_new_tokens, params, seeds[i], stop, k=scheduler.lookahead))
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

    def new_sequence(self, index: int, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams,
                     seed: int, stop: Seq[str] = (), k: int = 0) -> Sequence:
        """A validated request, ready for `Scheduler.submit`; k: tokens drafted per round (Scheduler.lookahead)."""
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if not _is_int(seed) or not 0 <= seed <= MAX_SEED:
            raise RequestError(f"seed must be an integer in [0, 2**64 - 1], got {seed!r}")
        stop = () if stop is None else stop
        if isinstance(stop, (str, bytes)) or not isinstance(stop, Seq) or not all(isinstance(s, str) and s for s in stop):
            raise RequestError(f"stop must be a list of non-empty strings, got {stop!r}")
        for s in stop:
            _check_text(s, "a stop string")
        need = len(prompt_ids) + max_new_tokens + k + 1
        if need > self.max_context:
            raise RequestError(
                f"prompt of {len(prompt_ids)} tokens + max_new_tokens {max_new_tokens} + speculation {k + 1} = {need} tokens, "
                f"above this bundle's max_context {self.max_context}; shorten the prompt or max_new_tokens, "
                "or compile with a larger limits.max_context"
            )
        return Sequence(index, list(prompt_ids), max_new_tokens, params, torch.Generator().manual_seed(seed),
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
                _check_text(p, f"prompt {i}")
                if chat:
                    ids = self.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                             tokenize=True, return_dict=False)
                else:
                    ids = self.tokenizer(p, add_special_tokens=True)["input_ids"]
            elif isinstance(p, Seq) and not isinstance(p, (bytes, bytearray)) and p and all(_is_int(t) for t in p):
                ids = [int(t) for t in p]
                bad = [t for t in ids if not 0 <= t < vocab]
                if bad:
                    raise RequestError(f"prompt {i} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
            else:
                raise RequestError(f"prompt {i} must be a non-empty string or list of token ids, got {type(p).__name__}")
            if not ids:
                raise RequestError(f"prompt {i} encodes to no tokens")
            out.append(list(ids))
        return out


class Scheduler:
    """Continuous batching: requests wait in a queue and join the running batch between rounds.

    `submit` may be called from any thread; `step` from one thread at a time. Each step
    prefills the waiting requests that fit in max_batch, then runs one round over the batch.
    """

    def __init__(self, model: SpecModel, speculative: bool = True, k: int | None = None, tree: TreeShape | None = None):
        self.model = model
        self.speculative = speculative and model.can_speculate
        if k is not None and tree is not None:
            raise RequestError("give k (chain speculation) or tree, not both")
        if tree is not None and not model.target.has_tree_mask:
            raise RequestError("this bundle was compiled for chain speculation; trees need speculation.mode tree in the recipe")
        if tree is not None and isinstance(model.drafter, (PromptLookupDrafter, LookupFirstDrafter)):
            raise RequestError("prompt-lookup drafting proposes chains, not trees")
        default_tree = model.tree if k is None else None
        self.tree = (tree or default_tree) if self.speculative else None
        self.k = (model.k if k is None else k) if self.speculative and self.tree is None else 0
        if k is not None and not (_is_int(k) and 1 <= k <= 16):
            raise RequestError(f"k must be an integer in [1, 16], got {k!r}")
        self.waiting: deque[Sequence] = deque()
        self.batch: Batch | None = None
        self.stats = RunStats()
        self._lock = threading.Lock()

    def submit(self, seq: Sequence) -> None:
        with self._lock:
            self.waiting.append(seq)
            self.stats.requests += 1

    @property
    def lookahead(self) -> int:
        """Most drafted tokens a round adds to a row's cache beyond its pending token."""
        return self.tree.size if self.tree is not None else self.k

    @property
    def busy(self) -> bool:
        return bool(self.waiting) or self.batch is not None

    def step(self) -> list[StreamEvent]:
        start = time.perf_counter()
        events = self._admit()
        if self.batch is not None:
            if self.tree is not None:
                new_tokens = self._tree_round(self.batch)
            elif self.speculative:
                new_tokens = self._speculative_round(self.batch)
            else:
                new_tokens = self._target_round(self.batch)
            events += self._advance(self.batch, new_tokens)
            if not self.batch.seqs:
                self.batch = None
        self.stats.seconds += time.perf_counter() - start
        return events

    # -- the rounds -----------------------------------------------------------------------
    def _admit(self) -> list[StreamEvent]:
        """Prefill waiting requests into free rows; emit their first tokens."""
        with self._lock:
            room = self.model.max_batch - (len(self.batch.seqs) if self.batch else 0)
            seqs = [self.waiting.popleft() for _ in range(min(room, len(self.waiting)))]
        if not seqs:
            return []
        batch, first = self._prefill(seqs)
        events = self._advance(batch, first)
        if batch.seqs:
            if self.batch is None:
                self.batch = batch
            else:
                self.batch.extend(batch)
                if self.speculative:
                    self.model.drafter.extend(self.batch, batch)
        return events

    def _prefill(self, seqs: list[Sequence]) -> tuple[Batch, list[list[int]]]:
        """Run the prompts through the target (and draft); returns the batch and each row's first token."""
        start = time.perf_counter()
        m = self.model
        ids, lengths = pad_right([s.prompt for s in seqs], m.device)
        cache = KVCache(m.target.dims, len(seqs), m.max_context, m.device)
        cache.ensure(int(lengths.max()) + self.lookahead + 1)
        batch = Batch(seqs, cache)
        if m.verify_head:
            _, token, new_k, new_v = self._head_step(batch, ids, (lengths - 1)[:, None], None, None, None,
                                                     None, batch.noise(1)[:, 0])
        else:
            logits, new_k, new_v = m.target(ids, cache, logit_index=(lengths - 1)[:, None])
            token, _ = choose(logits[:, 0], batch.params, batch.noise(1)[:, 0])
        cache.commit(new_k, new_v, lengths)
        if self.speculative:
            m.drafter.prefill(batch, ids, lengths)
        self.stats.prefill_seconds += time.perf_counter() - start
        return batch, [[t] for t in token.tolist()]

    def _target_round(self, batch: Batch) -> list[list[int]]:
        """The baseline: one target pass per token."""
        cache = batch.cache
        cache.ensure(int(cache.lengths.max()) + 1)
        start = time.perf_counter()
        first = torch.zeros_like(cache.lengths)[:, None]
        if self.model.verify_head:
            _, token, new_k, new_v = self._head_step(batch, batch.pending[:, None], first, None, None, None,
                                                     None, batch.noise(1)[:, 0])
        else:
            logits, new_k, new_v = self.model.target(batch.pending[:, None], cache, logit_index=first)
            token, _ = choose(logits[:, 0], batch.params, batch.noise(1)[:, 0])
        self.stats.target_seconds += time.perf_counter() - start
        cache.commit(new_k, new_v, torch.ones_like(cache.lengths))
        return [[t] for t in token.tolist()]

    def _speculative_round(self, batch: Batch) -> list[list[int]]:
        """Draft k, verify k+1 in one target pass, accept a prefix, commit its KV."""
        k, params = self.k, batch.params
        start = time.perf_counter()
        draft, q, n_draft = self.model.drafter.propose(batch, k, params)  # may propose fewer than k
        drafted = time.perf_counter()
        width = draft.shape[1]
        cache = batch.cache
        cache.ensure(int(cache.lengths.max()) + width + 1)
        ids = torch.cat([batch.pending[:, None], draft], dim=1)
        rows = torch.arange(width + 1, device=ids.device).expand(ids.shape[0], -1)
        u = batch.noise(k + 1)  # always k + 1 draws, so a row's noise stream does not depend on the batch
        if self.model.verify_head:
            n_acc, nxt, new_k, new_v = self._head_step(batch, ids, rows, draft, q, n_draft, u[:, :width], u[:, k])
        else:
            logits, new_k, new_v = self.model.target(ids, cache, logit_index=rows)
            n_acc, nxt = accept(logits, q, draft, n_draft, params, u[:, :width], u[:, k])
        self.stats.draft_seconds += drafted - start
        self.stats.target_seconds += time.perf_counter() - drafted
        cache.commit(new_k, new_v, n_acc + 1)
        self.model.drafter.after_verify(batch)
        out = []
        looked_up = self.model.lookup_first and self.model.drafter.looked_up
        for b, (n, d, t) in enumerate(zip(n_acc.tolist(), n_draft.tolist(), nxt.tolist())):
            batch.seqs[b].stats.record(d, n, looked_up)
            out.append(draft[b, :n].tolist() + [t])
        return out

    def _head_step(self, batch: Batch, ids: torch.Tensor, rows: torch.Tensor, draft, q, n_draft, u_accept, u_next):
        """A target pass through the verification head (insert_verify_head): acceptance in the graph.

        With no drafts (prefill, plain decode, an empty lookup) the head gets one dummy draft
        and n_draft 0, so it samples the next token from the first row of logits.
        """
        b = ids.shape[0]
        device, vocab = ids.device, self.model.target.dims.vocab_size
        if draft is None or draft.shape[1] == 0:
            draft = torch.zeros(b, 1, dtype=torch.long, device=device)
            n_draft = torch.zeros(b, dtype=torch.long, device=device)
            u_accept = torch.zeros(b, 1, device=device)
            rows = torch.cat([rows, rows[:, -1:]], dim=1)
        if q is None:
            q = torch.zeros(b, draft.shape[1], vocab, device=device)
        params = batch.params
        return self.model.target(ids, batch.cache, logit_index=rows, draft_tokens=draft, draft_probs=q,
                                 n_draft=n_draft, temperature=params.temperature, top_k=params.top_k,
                                 top_p=params.top_p, u_accept=u_accept, u_next=u_next)

    def _tree_round(self, batch: Batch) -> list[list[int]]:
        """Draft a token tree per row, verify all its nodes in one target pass, commit the accepted path."""
        params, shape = batch.params, self.tree
        start = time.perf_counter()
        trees = self.model.drafter.propose_tree(batch, shape, params)
        drafted = time.perf_counter()
        cache = batch.cache
        ids, depth, mask = tree_tensors(trees, first=0, device=cache.lengths.device)
        cache.ensure(int(cache.lengths.max()) + ids.shape[1])
        rows = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
        logits, new_k, new_v = self.model.target(ids, cache, logit_index=rows, positions=cache.lengths[:, None] + depth,
                                                 tree_mask=mask)
        self.stats.draft_seconds += drafted - start
        self.stats.target_seconds += time.perf_counter() - drafted
        u = batch.noise(shape.size + 2)
        probs = None if params.all_greedy else probs_from_logits(logits, params.temperature, params.top_k, params.top_p)
        paths, out = [], []
        for b, tree in enumerate(trees):
            n = tree.size + 1
            if params.greedy[b]:
                path, nxt = accept_tree_greedy(logits[b, :n], tree)
            else:
                path, nxt = accept_tree_sampled(probs[b, :n], tree, u[b])
            paths.append(path)
            batch.seqs[b].stats.record(max(tree.depth), len(path) - 1)
            out.append([tree.tokens[node] for node in path[1:]] + [nxt])
        index, counts = pad_right(paths, cache.lengths.device)
        cache.commit(new_k, new_v, counts, index=index)
        self.model.drafter.after_verify(batch)
        return out

    def _advance(self, batch: Batch, new_tokens: list[list[int]]) -> list[StreamEvent]:
        """Append each row's new tokens, stop rows at EOS / length / stop strings, emit text."""
        events, keep = [], []
        for b, (seq, toks) in enumerate(zip(batch.seqs, new_tokens)):
            taken = []
            for t in toks:
                if t in self.model.eos_ids:
                    seq.finish_reason = "stop"
                    break
                taken.append(t)
                if len(seq.out) + len(taken) >= seq.max_new_tokens:
                    seq.finish_reason = "length"
                    break
            seq.out.extend(taken)
            self.stats.new_tokens += len(taken)
            text, hit_stop = seq.text.update(seq.out, final=seq.finish_reason is not None)
            if hit_stop:
                seq.finish_reason = "stop"
            done = seq.finish_reason is not None
            if text or taken or done:
                events.append(StreamEvent(seq.index, text, taken, done, seq.finish_reason,
                                          seq.stats.to_dict() if done else None))
            if done:
                self.stats.speculation.merge(seq.stats)
            else:
                keep.append(b)
        if len(keep) < len(batch.seqs):
            rows = batch.keep_rows(keep)
            if self.speculative and keep:
                self.model.drafter.keep_rows(batch, rows)
        return events


class Completions(list):
    """The completions of one `generate` call, in prompt order; `stats` are that call's RunStats."""

    def __init__(self, items: list[Completion], stats: RunStats):
        super().__init__(items)
        self.stats = stats


MAX_SEED = 2**64 - 1  # a torch generator's seed range (and the Triton interface's UINT64 seed)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_text(text: str, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(f"{what} is not valid Unicode text: {exc.reason} at character {exc.start} "
                           f"({text[exc.start:exc.end]!r}); send UTF-8 text") from None


def _seeds(seed, n: int) -> list[int]:
    if _is_int(seed):
        seeds = [int(seed) + i for i in range(n)]
    else:
        seeds = list(seed) if isinstance(seed, Seq) and not isinstance(seed, (str, bytes)) else []
        if len(seeds) != n or not all(_is_int(s) for s in seeds):
            raise RequestError(f"seed must be one int or one int per prompt ({n}), got {seed!r}")
    if not all(0 <= s <= MAX_SEED for s in seeds):
        raise RequestError(f"seed must be in [0, 2**64 - 1] (row i uses seed + i), got {seed!r}")
    return [int(s) for s in seeds]


def open_runner(bundle: Bundle, role: str) -> Runner:
    """Open one graph of a bundle with the bundle's backend, in this process (versions and code trust checked).

    The bundle's files were checked by `open_bundle`; a loader that still fails (a file corrupted
    under --no-verify, an engine this machine cannot run) is a BundleError naming the graph."""
    m = bundle.manifest
    check_code_trust(bundle, get_backend(m.backend, check=False).runs_bundle_code)
    backend = get_backend(m.backend)
    backend.check_versions(m.versions)
    entry = bundle.graph(role)
    options = LowerOptions(m.recipe.precision, m.recipe.device, entry.quantize)
    where = f"the {role} graph of bundle {bundle.path} ({m.backend}, {entry.dir}/{entry.entry})"
    try:
        return CheckedRunner(backend.load(bundle.path / entry.dir, entry.to_dict(), options), where)
    except SpeccError:
        raise
    except Exception as exc:  # loaders raise their own types for unreadable engine files
        raise BundleError(f"{where} could not be loaded: {type(exc).__name__}: {str(exc)[:300]}. If it was opened "
                          "with --no-verify, a file may be corrupt: open it with verification") from None


class CheckedRunner:
    """A backend's runner whose failures are BundleErrors: an engine that rejects the inputs its
    manifest declares (a manifest that does not describe its engine) is a bad bundle, not a crash."""

    def __init__(self, runner: Runner, where: str):
        self.runner, self.where = runner, where
        self.output_names = runner.output_names

    def __call__(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        try:
            outputs = self.runner(*inputs)
        except SpeccError:
            raise
        except Exception as exc:  # the engine's own error types (onnxruntime, torch, TensorRT)
            raise BundleError(f"{self.where} failed on the inputs its manifest declares: {type(exc).__name__}: "
                              f"{str(exc)[:300]}") from None
        if len(outputs) != len(self.output_names):
            raise BundleError(f"{self.where} returned {len(outputs)} outputs; its manifest declares {self.output_names}")
        return outputs


def load_tokenizer(bundle: Bundle):
    """The bundle's tokenizer (its files were checked with the rest of the bundle)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(bundle.path / bundle.manifest.tokenizer.dir)
    except Exception as exc:  # transformers raises many types for unreadable tokenizer files
        raise BundleError(f"the tokenizer of bundle {bundle.path} could not be loaded: {type(exc).__name__}: "
                          f"{str(exc)[:300]}") from None


def load(path: str | Path, verify: bool = True, expect_id: str | None = None, trust_code: bool = False) -> SpecModel:
    """Open a bundle and load its engines.

    verify: check every file's sha256 (sizes and the file listing are always checked).
    expect_id: refuse a bundle whose id (`specc inspect`) differs: what production pins.
    trust_code: allow backends that execute code from the bundle (aoti, torch_tensorrt)."""
    return SpecModel(open_bundle(path, verify=verify, expect_id=expect_id, trust_code=trust_code))
