"""SpecModel: a loaded bundle that generates text with speculative rounds.

One round (chain):  draft k tokens → verify k+1 on the target → accept → commit.
A Scheduler runs rounds over a batch that requests join and leave between rounds.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence as Seq

import torch

from ..backends import LowerOptions, Runner, get_backend
from ..bundle import Bundle, open_bundle
from ..capture.export import ModelDims
from ..errors import BundleError, RequestError
from .adaptive import AdaptiveK, RoundRecord
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
    finish_reason: str | None = None  # "stop" (EOS or stop string), "length", or "cancelled" (Scheduler.cancel)
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
        self.target = self._load_graph("target")
        self.verify_head = "n_accepted" in self.bundle.graph("target")["outputs"]
        self.draft_method = m["draft"]["method"]
        self.drafter = None
        lookup = PromptLookupDrafter(recipe["draft"]["max_ngram"], recipe["draft"]["min_ngram"], self.target.dims.vocab_size)
        if m["draft"].get("graph"):
            kind = SharedCacheDrafter if m["draft"].get("shares_target_cache") else ModelDrafter
            self.drafter = kind(self._load_graph(m["draft"]["graph"]), self.max_context)
            if recipe["draft"].get("lookup"):
                self.drafter = LookupFirstDrafter(lookup, self.drafter)
        elif self.draft_method == "prompt_lookup":
            self.drafter = lookup
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
               seed: int | Seq[int] = 0, stop: Seq[str] = (), speculative: bool = True, k: int | str | None = None,
               tree: TreeShape | None = None, chat: bool = False) -> Iterator[StreamEvent]:
        """Yield text as rounds complete; at most max_batch rows run at once, the rest join as rows finish.

        prompts: strings (or token-id lists); chat applies the tokenizer's chat template.
        seed: one int (row i uses seed + i) or one per prompt. speculative=False runs the
        same compiled target without drafting (the in-run baseline). k asks for chain
        speculation of that length, tree for that token tree (bundles compiled for trees);
        neither: the recipe's speculation. k="auto" chooses k in [0, k_max] every round from the
        measured acceptance and costs (runtime/adaptive.py).
        """
        params = self.sampling_params(temperature, top_k, top_p)
        encoded = self.encode(prompts, chat)
        seeds = _seeds(seed, len(encoded))
        scheduler = Scheduler(self, speculative=speculative, k=k, tree=tree)
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
        if isinstance(stop, str) or not all(isinstance(s, str) and s for s in stop):
            raise RequestError(f"stop must be a list of non-empty strings, got {stop!r}")
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


class Scheduler:
    """Continuous batching: requests wait in a queue and join the running batch between rounds.

    `submit` may be called from any thread; `step` from one thread at a time. Each step
    prefills the waiting requests that fit in max_batch, then runs one round over the batch.
    """

    def __init__(self, model: SpecModel, speculative: bool = True, k: int | str | None = None, tree: TreeShape | None = None,
                 max_batch: int | None = None):
        """k: chain length, or "auto" (AdaptiveK picks 0..k_max each round; k_max: the recipe's k, at least
        AUTO_K_MAX); max_batch: at most this many rows (default and upper bound: the bundle's limits.max_batch)."""
        self.model = model
        self.max_batch = model.max_batch if max_batch is None else max_batch
        if not (isinstance(self.max_batch, int) and 1 <= self.max_batch <= model.max_batch):
            raise RequestError(f"max_batch must be in [1, {model.max_batch}] (the bundle's limits.max_batch), got {max_batch!r}")
        self.speculative = speculative and model.can_speculate
        if k is not None and tree is not None:
            raise RequestError("give k (chain speculation) or tree, not both")
        if tree is not None and not model.target.has_tree_mask:
            raise RequestError("this bundle was compiled for chain speculation; trees need speculation.mode tree in the recipe")
        if tree is not None and isinstance(model.drafter, (PromptLookupDrafter, LookupFirstDrafter)):
            raise RequestError("prompt-lookup drafting proposes chains, not trees")
        default_tree = model.tree if k is None else None
        self.tree = (tree or default_tree) if self.speculative else None
        self.policy = None
        if isinstance(k, str) and k != "auto":
            raise RequestError(f"k must be an integer in [1, 16] or 'auto', got {k!r}")
        if k == "auto":
            self.policy = AdaptiveK(max(model.k, AUTO_K_MAX)) if self.speculative and self.tree is None else None
            k = self.policy.k_max if self.policy else None
        self.k = (model.k if k is None else k) if self.speculative and self.tree is None else 0
        if self.k and not (isinstance(self.k, int) and 1 <= self.k <= 16):
            raise RequestError(f"k must be in [1, 16], got {self.k!r}")
        self.waiting: deque[Sequence] = deque()
        self.batch: Batch | None = None
        self.stats = RunStats()
        self.last_round: RoundRecord | None = None  # the latest decode round (policy, metrics)
        self._cancelled: set[int] = set()
        self._lock = threading.Lock()

    def submit(self, seq: Sequence) -> None:
        with self._lock:
            self.waiting.append(seq)
            self.stats.requests += 1

    def cancel(self, index: int) -> None:
        """Stop request `index` (any thread): it leaves the queue or frees its row at the next step,
        which emits its last event with finish_reason "cancelled". Unknown or finished: no effect."""
        with self._lock:
            self._cancelled.add(index)

    @property
    def lookahead(self) -> int:
        """Most drafted tokens a round adds to a row's cache beyond its pending token."""
        return self.tree.size if self.tree is not None else self.k

    @property
    def busy(self) -> bool:
        return bool(self.waiting) or self.batch is not None

    def step(self) -> list[StreamEvent]:
        start = time.perf_counter()
        events = self._drop_cancelled() + self._admit()
        if self.batch is not None:
            round_start, before = time.perf_counter(), (self.stats.draft_seconds, self.stats.target_seconds)
            rows = [s.index for s in self.batch.seqs]
            k, counts = self.k, None
            if self.tree is not None:
                new_tokens = self._tree_round(self.batch)
            elif self.speculative and (k := self.policy.choose(rows) if self.policy else self.k):
                new_tokens, counts = self._speculative_round(self.batch, k)
            else:
                k, new_tokens = 0, self._target_round(self.batch)
            n_draft, n_acc = counts or ([0] * len(rows), [0] * len(rows))
            self.last_round = RoundRecord(rows, k, n_draft, n_acc, self.stats.draft_seconds - before[0],
                                          self.stats.target_seconds - before[1], time.perf_counter() - round_start)
            if self.policy is not None:
                self.policy.observe(self.last_round)
            events += self._advance(self.batch, new_tokens)
            if not self.batch.seqs:
                self.batch = None
        self.stats.seconds += time.perf_counter() - start
        return events

    # -- the rounds -----------------------------------------------------------------------
    def _drop_cancelled(self) -> list[StreamEvent]:
        """Remove cancelled requests from the queue and their rows from the batch."""
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
            gone = [s for s in self.waiting if s.index in cancelled]
            self.waiting = deque(s for s in self.waiting if s.index not in cancelled)
        if cancelled and self.batch is not None:
            keep = [b for b, s in enumerate(self.batch.seqs) if s.index not in cancelled]
            running = [s for s in self.batch.seqs if s.index in cancelled]
            for seq in running:
                self.stats.speculation.merge(seq.stats)
            if not keep:
                self.batch = None
            elif running:
                rows = self.batch.keep_rows(keep)
                if self.speculative:
                    self.model.drafter.keep_rows(self.batch, rows)
            gone += running
        return [StreamEvent(s.index, "", [], True, "cancelled", s.stats.to_dict()) for s in gone]

    def _admit(self) -> list[StreamEvent]:
        """Prefill waiting requests into free rows; emit their first tokens."""
        with self._lock:
            room = self.max_batch - (len(self.batch.seqs) if self.batch else 0)
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

    def _speculative_round(self, batch: Batch, k: int) -> tuple[list[list[int]], tuple[list[int], list[int]]]:
        """Draft k, verify k+1 in one target pass, accept a prefix, commit its KV.

        Returns each row's new tokens and (drafted, accepted) counts per row."""
        params = batch.params
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
        counts = (n_draft.tolist(), n_acc.tolist())
        for b, (n, d, t) in enumerate(zip(counts[1], counts[0], nxt.tolist())):
            batch.seqs[b].stats.record(d, n, looked_up)
            out.append(draft[b, :n].tolist() + [t])
        return out, counts

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


AUTO_K_MAX = 8  # k "auto" considers k up to max(the recipe's k, this)


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
