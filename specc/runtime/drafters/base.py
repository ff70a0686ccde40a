"""What a drafter is: it proposes tokens for every row of a batch; the target verifies them.

A round calls `prefill`, `propose` (or `propose_tree`) and `after_verify`; the adaptive policy and
`specc tune` price a drafter through `arms`, `behind`, `finds` and `probe`. What a drafter can do
(trees, early stops, a front in front of it, prompt features, a lazy prefill, how tune times it) is
its row of the method table (specc/methods.py), `Drafter.method`.

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
from ..record import DraftPlan, RoundRecord
from ..state import Batch
from ..step import DEFAULT_CHUNK, StepRunner


@dataclass
class Proposal:
    """One round's drafts: tokens [B, W] (W <= k, rows right-padded); q [B, W, V] the distributions
    they were drawn from (None when every row is greedy); lengths [B] valid drafts per row; record: the
    round's record, started by the drafter with what it alone knows (rows skipped, catch-up, classes)."""

    tokens: torch.Tensor
    q: torch.Tensor | None
    lengths: torch.Tensor
    record: RoundRecord = field(default_factory=RoundRecord)

    @classmethod
    def empty(cls, batch: Batch, params: RowParams, vocab: int, record: RoundRecord) -> "Proposal":
        """No drafts for any row: the round verifies only each row's pending token."""
        device = batch.cache.lengths.device
        tokens = torch.zeros(len(batch.seqs), 0, dtype=torch.long, device=device)
        q = None if params.all_greedy else torch.zeros(*tokens.shape, vocab, device=device)
        return cls(tokens, q, torch.zeros(len(batch.seqs), dtype=torch.long, device=device), record)


def one_hot_proposal(drafts: list[list[int]], classes: list[int], params: RowParams, vocab: int, device) -> Proposal:
    """Rows' drafts as a Proposal: tokens right-padded, one-hot q for sampled rows, each row's class."""
    width = max((len(d) for d in drafts), default=0)
    tokens = torch.zeros(len(drafts), width, dtype=torch.long, device=device)
    for b, d in enumerate(drafts):
        tokens[b, :len(d)] = torch.tensor(d, dtype=torch.long)
    lengths = torch.tensor([len(d) for d in drafts], dtype=torch.long, device=device)
    q = None
    if not params.all_greedy:
        q = torch.zeros(len(drafts), width, vocab, device=device).scatter_(-1, tokens[..., None], 1.0)
    return Proposal(tokens, q, lengths, RoundRecord(classes=classes))


@dataclass
class DraftContext:
    """What a drafter may take from its bundle when it is built."""

    settings: dict  # the recipe's draft section
    graph: str | None  # role of the draft graph in the bundle, if it has one
    open_graph: Callable[[str], StepRunner]  # opens a graph of the bundle by role
    max_context: int
    vocab_size: int


class Drafter:
    """Base class; `method` is its row of the method table (what it can do).

    A round calls prefill, propose (propose_tree) and after_verify; `arms`, `behind`, `finds` and `probe`
    are what the adaptive policy (runtime/adaptive.py) and `specc tune` read to price it."""

    method: DraftMethod
    front: "Drafter | None" = None  # a cheap drafter in front of this one (`FrontDrafter`)

    @classmethod
    def build(cls, ctx: DraftContext) -> "Drafter":
        raise NotImplementedError

    # -- a round ---------------------------------------------------------------------------------
    def prefill(self, batch: Batch, ids: torch.Tensor, lengths: torch.Tensor, verdict) -> None:
        """Take in the prompts (ids [B, T] right-padded, lengths [B]) once the target has committed them;
        `verdict.extra` holds further outputs of the target over the prompt tokens (e.g. `features`)."""

    def propose(self, batch: Batch, params: RowParams, plan: DraftPlan) -> Proposal:
        """Up to plan.k draft tokens per row, drawn with each row's own noise."""
        raise NotImplementedError

    def propose_tree(self, batch: Batch, shape: TreeShape, params: RowParams) -> list[DraftTree]:
        """One token tree per row (methods with `trees`)."""
        raise RequestError(f"{self.method.name} drafting proposes chains, not trees")

    def drafting(self, batch: Batch) -> "Drafter":
        """Who drafts this batch's next round: this drafter, or for a drafter with a front, the front where
        it has drafts for every row (`FrontDrafter`); hooks (prefill, after_verify) still go to this one."""
        return self

    def after_verify(self, batch: Batch, verdict) -> None:
        """Called once the target's verdict is committed (`runtime.verifier.Verdict`)."""

    def finished(self, seq) -> None:
        """Request `seq` (a `Request`) has finished or was cancelled (a drafter that learns from outputs
        takes its last tokens here)."""

    # -- settings the engine hands down --------------------------------------------------------------
    def set_prefill_chunk(self, tokens: int) -> None:
        """Most tokens per row it enters in one pass (drafters with a prefill of their own)."""

    @property
    def suffix_cache(self):
        """The global suffix cache it drafts from (runtime/drafters/suffix.py), or None."""
        return None

    @property
    def label(self) -> str:
        """Its name in tables: the method, with its front's ("quantized+lookup")."""
        return self.method.name

    # -- pricing ---------------------------------------------------------------------------------
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


def with_method(drafter: Drafter, name: str) -> Drafter:
    """The drafter with its row of the method table attached."""
    drafter.method = get_method(name)
    return drafter


class GraphDrafter(Drafter):
    """A drafter that runs one draft graph of its bundle (a draft model, early-exit layers or a learned head).

    prefill_chunk: most tokens per row it enters in one pass (`Engine.prefill_chunk` sets it)."""

    prefill_chunk = DEFAULT_CHUNK

    def __init__(self, step: StepRunner, max_context: int):
        self.step, self.max_context = step, max_context

    def set_prefill_chunk(self, tokens: int) -> None:
        self.prefill_chunk = tokens

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
        self.prob = torch.ones(drafting.shape, device=drafting.device)  # the chain's probability so far

    def update(self, i: int, logits: torch.Tensor, tokens: torch.Tensor) -> bool:
        """After draft i (0-based) of every row, drawn from logits [B, V]; False once no row drafts on."""
        if not self.below:
            return True
        prob = torch.softmax(logits.float(), -1).gather(1, tokens[:, None])[:, 0]
        self.prob = self.prob * prob if self.chain else prob
        ending = self.going & (self.prob < self.below)
        self.n_draft = torch.where(ending, i + 1, self.n_draft)
        self.going &= ~ending
        return bool(self.going.any())
