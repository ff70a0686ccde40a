"""What a drafter is: it proposes tokens for every row of a batch; the target verifies them.

A drafter object holds only its configuration and graphs; what it keeps between rounds lives
on the batch (`Batch.draft_cache`), so batches can grow and shrink under it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ...errors import RequestError
from ...speculation.sampling import RowParams
from ...speculation.tree import DraftTree, TreeShape
from ..state import Batch
from ..step import StepRunner


@dataclass
class Proposal:
    """One round's drafts for a batch.

    tokens [B, W] drafted tokens (W <= k, rows right-padded); q [B, W, V] the distributions they
    were drawn from (None when every row is greedy); lengths [B] valid drafts per row (0: nothing
    to verify); source: who drafted them (the drafter's kind, or "lookup" for a prompt-lookup
    round in front of a draft model), for the statistics; skipped: rows left without drafts
    because the drafter has not taken in their context yet and was told not to (`propose(warm=False)`,
    for a round that only probes whether drafting pays); catch_up_seconds, catch_up_tokens: time
    spent entering context the drafter had not taken in, and how many tokens (a lazy prefill or a
    catch-up after rounds it did not draft: not the cost of this round's drafts); stop_below: the
    threshold under which the drafter ended chains early (`Stops`; 0: every chain ran to k, or to what
    prompt lookup found), for an adaptive policy to read a short chain as a stop, not a rejection;
    classes: per row, the class of its drafts where the drafter tells them apart (`Drafter.finds`;
    prompt lookup: the length of the n-gram it matched, 0 where it found nothing), else None.
    """

    tokens: torch.Tensor
    q: torch.Tensor | None
    lengths: torch.Tensor
    source: str
    skipped: list[int] = field(default_factory=list)
    catch_up_seconds: float = 0.0
    catch_up_tokens: int = 0
    stop_below: float = 0.0
    classes: list[int] | None = None


@dataclass
class DraftContext:
    """What a drafter may take from its bundle when it is built."""

    settings: dict  # the recipe's draft section
    graph: str | None  # role of the draft graph in the bundle, if it has one
    shares_target_cache: bool  # the draft graph is the target's first layers (early exit)
    open_graph: Callable[[str], StepRunner]  # opens a graph of the bundle by role
    max_context: int
    vocab_size: int


class Drafter:
    """Base class. `kind` names the drafter in tables; `cost` tells `specc tune` how a round is
    priced: "step" (k calls of a draft graph) or "lookup" (one n-gram lookup)."""

    kind = "drafter"
    cost = "step"
    supports_tree = False
    lookup_first = False  # prompt lookup in front of a draft model (recipe draft.lookup)
    lazy_prefill = False  # takes a row's context in when it first drafts for it (a draft model's cache)
    stops = False  # drafts one token at a time and can end a row's chain early (`propose(stop_below=...)`)

    @classmethod
    def build(cls, ctx: DraftContext) -> "Drafter":
        raise NotImplementedError

    @property
    def arms(self) -> dict[str, "Drafter"]:
        """The ways this drafter can draft a round, by name, for an adaptive policy to choose from; each
        proposes, while this drafter keeps receiving every hook (prefill, after_verify, ...)."""
        return {"draft": self}

    def prefill(self, batch: Batch, ids: torch.Tensor, lengths: torch.Tensor) -> None:
        """Take in the prompts (ids [B, T] right-padded, lengths [B]) once the target has."""

    def after_prefill(self, batch: Batch, lengths: torch.Tensor, verdict) -> None:
        """Called once the prompts' target pass is committed, with its verdict (`extra` holds further
        outputs of the target graph over the prompt tokens, e.g. `features`): for drafters that read them."""

    def behind(self, batch: Batch) -> list[int]:
        """Tokens of each row this drafter would take in before its next drafts (a lazy prefill, or a
        catch-up after rounds it did not draft for): what an adaptive policy must price in. 0 for
        drafters that draft from what they already hold."""
        return [0] * len(batch.seqs)

    def finds(self, batch: Batch) -> list[int] | None:
        """What each row would get this round, for drafters that know beforehand: 0 no drafts, else the
        class of its drafts, drafts of one class being accepted alike (prompt lookup: the length of the
        n-gram it matched; a three-token match is accepted far more often than a one-token one); None:
        it drafts for every row and cannot tell them apart."""
        return None

    def propose(self, batch: Batch, k: int, params: RowParams, warm: bool = True, stop_below: float = 0.0,
                stop_chain: bool = False) -> Proposal:
        """Up to k draft tokens per row, drawn with each row's own noise. warm=False: a drafter that
        takes in a row's context lazily (a draft model's prefill) may skip rows it has not taken in yet,
        for a round that only probes whether drafting pays. stop_below: a drafter of one token at a time
        (`stops`: a draft model, an EAGLE head) ends a row's drafts after the first one it gave a probability
        below this, or with stop_chain, after the first at which the row's whole chain (the product of its
        drafts' probabilities) falls below it (`Stops`); the others ignore both."""
        raise NotImplementedError

    def propose_tree(self, batch: Batch, shape: TreeShape, params: RowParams) -> list[DraftTree]:
        """One token tree per row (drafters with supports_tree)."""
        raise RequestError(f"{self.kind} drafting proposes chains, not trees")

    def after_verify(self, batch: Batch, verdict) -> None:
        """Called after the target's verdict is committed (`runtime.target.Verdict`, whose `extra`
        holds further outputs of the target graph): for drafters that read the target's results."""

    def probe(self, batch: Batch, k: int) -> Callable[[], object]:
        """A call that does one unit of drafting work on this batch (one draft-graph step of one
        token, or one lookup of k tokens) without changing any state: what `specc tune` times."""
        raise NotImplementedError


class GraphDrafter(Drafter):
    """A drafter that runs one draft graph of its bundle (the recipe's draft model, early-exit layers
    or a learned head)."""

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
