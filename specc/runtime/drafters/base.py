"""What a drafter is: it proposes tokens for every row of a batch; the target verifies them.

The core a round calls is four methods: `prefill`, `propose` (or `propose_tree`), `after_verify`
and `close`. What the adaptive policy and `specc tune` need to price a drafter (`arms`, `behind`,
`finds`, `probe`, `cost`, `lazy_prefill`) is the separate `Priced` protocol. What a drafter can do
(trees, early stops, prompt lookup in front) is its row of the method table (specc/methods.py).

A drafter object holds only its configuration and graphs; what it keeps between rounds lives on
the batch (`Batch.draft_state`, a `DraftState`), so batches can grow and shrink under it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ...errors import RequestError
from ...methods import DraftMethod, get_method
from ...speculation.sampling import RowParams
from ...speculation.tree import DraftTree, TreeShape
from ..state import Batch
from ..step import DEFAULT_CHUNK, StepRunner


@dataclass(frozen=True)
class DraftPlan:
    """How to draft one chain round: up to k tokens per row.

    arm: which of the drafter's ways of drafting runs (`Priced.arms`; None: the drafter itself).
    warm=False: a drafter that takes a row's context in lazily may skip rows it has not taken in yet
    (a round that only probes whether drafting pays). stop_below: a drafter of one token at a time ends
    a row's chain after the first draft it gave a probability below this, or with stop_chain, after the
    first at which the product of the chain's probabilities falls below it (`Stops`)."""

    k: int
    arm: str | None = None
    warm: bool = True
    stop_below: float = 0.0
    stop_chain: bool = False


@dataclass
class DraftInfo:
    """What a proposal tells the adaptive policy besides its drafts.

    skipped: rows left without drafts because the drafter had not taken them in (`DraftPlan.warm`);
    catch_up_seconds, catch_up_tokens: time and tokens spent entering context the drafter lacked (a
    lazy prefill, or a catch-up after rounds it did not draft), not the cost of this round's drafts;
    stop_below: the threshold under which chains ended early (0: none could); classes: per row, the
    class of its drafts where the drafter tells them apart (`Priced.finds`), else None."""

    skipped: list[int] = field(default_factory=list)
    catch_up_seconds: float = 0.0
    catch_up_tokens: int = 0
    stop_below: float = 0.0
    classes: list[int] | None = None


@dataclass
class Proposal:
    """One round's drafts: tokens [B, W] (W <= k, rows right-padded); q [B, W, V] the distributions
    they were drawn from (None when every row is greedy); lengths [B] valid drafts per row; source: who
    drafted them, for the statistics (the drafter's kind, or "lookup" for prompt lookup in front of a model)."""

    tokens: torch.Tensor
    q: torch.Tensor | None
    lengths: torch.Tensor
    source: str
    info: DraftInfo = field(default_factory=DraftInfo)

    @classmethod
    def empty(cls, batch: Batch, params: RowParams, vocab: int, source: str, info: DraftInfo) -> "Proposal":
        """No drafts for any row: the round verifies only each row's pending token."""
        device = batch.cache.lengths.device
        tokens = torch.zeros(len(batch.seqs), 0, dtype=torch.long, device=device)
        q = None if params.all_greedy else torch.zeros(*tokens.shape, vocab, device=device)
        return cls(tokens, q, torch.zeros(len(batch.seqs), dtype=torch.long, device=device), source, info)


def one_hot_proposal(drafts: list[list[int]], classes: list[int], params: RowParams, vocab: int, device,
                     source: str) -> Proposal:
    """Rows' drafts as a Proposal: tokens right-padded, one-hot q for sampled rows, each row's class."""
    width = max((len(d) for d in drafts), default=0)
    tokens = torch.zeros(len(drafts), width, dtype=torch.long, device=device)
    for b, d in enumerate(drafts):
        tokens[b, :len(d)] = torch.tensor(d, dtype=torch.long)
    lengths = torch.tensor([len(d) for d in drafts], dtype=torch.long, device=device)
    q = None
    if not params.all_greedy:
        q = torch.zeros(len(drafts), width, vocab, device=device).scatter_(-1, tokens[..., None], 1.0)
    return Proposal(tokens, q, lengths, source, DraftInfo(classes=classes))


@dataclass
class DraftContext:
    """What a drafter may take from its bundle when it is built."""

    settings: dict  # the recipe's draft section
    graph: str | None  # role of the draft graph in the bundle, if it has one
    open_graph: Callable[[str], StepRunner]  # opens a graph of the bundle by role
    max_context: int
    vocab_size: int


class Priced:
    """What the adaptive policy (runtime/adaptive.py) and `specc tune` read to price a drafter.

    cost: how tune times a round: "step" (k calls of a draft graph) or "lookup" (one n-gram lookup).
    lazy_prefill: the drafter takes a row's context in when it first drafts for it (a draft model)."""

    cost = "step"
    lazy_prefill = False

    @property
    def arms(self) -> dict[str, "Drafter"]:
        """The ways this drafter can draft a round, by name; each proposes, while this drafter keeps
        receiving every hook (prefill, after_verify)."""
        return {"draft": self}

    def behind(self, batch: Batch) -> list[int]:
        """Tokens of each row this drafter would take in before its next drafts (0: none)."""
        return [0] * len(batch.seqs)

    def finds(self, batch: Batch) -> list[int] | None:
        """Per row, what this round would get where the drafter knows beforehand: 0 no drafts, else the
        class of its drafts (prompt lookup: the matched n-gram's length); None: it cannot tell."""
        return None

    def probe(self, batch: Batch, k: int) -> Callable[[], object]:
        """A call doing one unit of drafting work on this batch without changing any state (what tune times)."""
        raise NotImplementedError


class Drafter(Priced):
    """Base class. `kind` names the drafter in statistics; `method` is its row of the method table."""

    kind = "drafter"
    method: DraftMethod
    prompt_features = False  # prefill hands it the target's features of every prompt token (no prefix cache then)

    @classmethod
    def build(cls, ctx: DraftContext) -> "Drafter":
        raise NotImplementedError

    def prefill(self, batch: Batch, ids: torch.Tensor, lengths: torch.Tensor, verdict) -> None:
        """Take in the prompts (ids [B, T] right-padded, lengths [B]) once the target has committed them;
        `verdict.extra` holds further outputs of the target over the prompt tokens (e.g. `features`)."""

    def propose(self, batch: Batch, params: RowParams, plan: DraftPlan) -> Proposal:
        """Up to plan.k draft tokens per row, drawn with each row's own noise."""
        raise NotImplementedError

    def propose_tree(self, batch: Batch, shape: TreeShape, params: RowParams) -> list[DraftTree]:
        """One token tree per row (methods with `trees`)."""
        raise RequestError(f"{self.kind} drafting proposes chains, not trees")

    def after_verify(self, batch: Batch, verdict) -> None:
        """Called once the target's verdict is committed (`runtime.verifier.Verdict`)."""

    def finished(self, seq) -> None:
        """Request `seq` (a `Request`) has finished or was cancelled (a drafter that learns from outputs
        takes its last tokens here)."""

    def close(self) -> None:
        """Release what the drafter holds beyond its batch state."""


def with_method(drafter: Drafter, name: str) -> Drafter:
    """The drafter with its row of the method table attached."""
    drafter.method = get_method(name)
    return drafter


class GraphDrafter(Drafter):
    """A drafter that runs one draft graph of its bundle (a draft model, early-exit layers or a learned head).

    prefill_chunk: most tokens per row it enters in one pass (SpecModel.prefill_chunk sets it)."""

    prefill_chunk = DEFAULT_CHUNK

    def __init__(self, step: StepRunner, max_context: int):
        self.step, self.max_context = step, max_context

    @classmethod
    def build(cls, ctx: DraftContext) -> "GraphDrafter":
        return cls(ctx.open_graph(ctx.graph), ctx.max_context)


class Stops:
    """Early stops of a chain (recipe draft.stop_below, or k auto's cost rule): which rows still draft, and
    how many drafts each has.

    A row stops after the first draft whose probability under the drafter's softmax is below the threshold
    (chain=True: after the first at which the product of its drafts' probabilities, the drafter's estimate
    that the whole chain is accepted, is below it). The stop depends only on the drafter's own logits and
    draws, never on the target, so every round is still an ordinary speculative round over a chain of that
    row's length: acceptance stays exact."""

    def __init__(self, drafting: torch.Tensor, k: int, below: float, chain: bool = False):
        self.below, self.chain, self.going, self.n_draft = below, chain, drafting.bool(), k * drafting
        self.sure = torch.ones(drafting.shape, device=drafting.device)  # the chain's probability so far

    def update(self, i: int, logits: torch.Tensor, tokens: torch.Tensor) -> bool:
        """After draft i (0-based) of every row, drawn from logits [B, V]; False once no row drafts on."""
        if not self.below:
            return True
        sure = torch.softmax(logits.float(), -1).gather(1, tokens[:, None])[:, 0]
        self.sure = self.sure * sure if self.chain else sure
        unsure = self.going & (self.sure < self.below)
        self.n_draft = torch.where(unsure, i + 1, self.n_draft)
        self.going &= ~unsure
        return bool(self.going.any())
