"""What each round drafts: a fixed k or the adaptive policy (runtime/adaptive.py) for chains, and for trees
how much of the drafted trees a round verifies (`TreeSizer`, `LookaheadGate`).

A planner answers `plan(batch)` before a chain round (k 0: a plain round) and learns from the round's
`RoundRecord` in `observe`. Nothing here touches the batch: the choice depends only on finished rounds
and the context so far, so every round stays an ordinary lossless speculative round.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..limits import auto_k_max
from ..speculation.tree import DraftTree, rerank
from .adaptive import MIN_GAIN_LAZY_PREFILL, AdaptiveK, CostLine
from .drafters.base import Drafter
from .engine import Engine
from .record import DraftPlan, RoundRecord
from .state import Batch


class Planner:
    """A fixed chain length k (0: plain rounds only), with early stops below `stop_below`."""

    policy: AdaptiveK | None = None  # what learns from the rounds (k auto)

    def __init__(self, k: int, stop_below: float = 0.0):
        self.k, self.stop_below = k, stop_below

    @property
    def k_max(self) -> int:
        """The longest chain a round may draft."""
        return self.k

    def plan(self, batch: Batch) -> DraftPlan:
        return DraftPlan(self.k, stop_below=self.stop_below)

    def observe(self, record: RoundRecord) -> None:
        """A finished round (a fixed k learns nothing)."""


class AdaptivePlanner(Planner):
    """k "auto": the policy picks each round's arm and k in [0, k_max] from the rounds it observed."""

    def __init__(self, policy: AdaptiveK, drafter: Drafter):
        super().__init__(policy.k_max)
        self.policy, self.drafter = policy, drafter

    def plan(self, batch: Batch) -> DraftPlan:
        seqs, arms = batch.seqs, self.drafter.arms
        return self.policy.choose([s.index for s in seqs], remaining=[s.max_new_tokens - len(s.out) for s in seqs],
                                  behind={name: d.behind(batch) for name, d in arms.items()},
                                  finds={name: d.finds(batch) for name, d in arms.items()})

    def observe(self, record: RoundRecord) -> None:
        self.policy.observe(record)


class TreeSizer:
    """How many of each row's drafted nodes a tree round verifies, for drafters whose node scores estimate
    acceptance (suffix decoding: a node's path frequency in its index).

    A row keeps its n highest-scoring nodes (`rerank`: a kept node's parent is kept); n, the same for every
    row, maximises the round's expected tokens per second,

        sum over rows b of (1 + kappa * sum of p_bi over its kept nodes)  /  (a + c * width),

    where p_bi = exp(score) is the drafter's estimate that node i is accepted, kappa the measured ratio of
    accepted nodes to what the estimates promised over recent rounds (the estimates are counts in past text,
    not the target's probabilities), and a + c * width the measured seconds of a round against the widest
    row's verified nodes (`CostLine`, fitted as k auto fits its rounds; a prior slope until two widths are seen).
    n = 0 verifies no draft: a tree round then costs what a plain round does. A short match already drafts a
    small tree (the drafter's budget); this sizes the tree to what a verify pass of that width costs here.
    """

    PRIOR_SLOPE = 0.05  # a verified node's seconds as a share of a one-token pass, until measured

    def __init__(self, most: int, decay: float = 0.9):
        self.most, self.line = most, CostLine(decay)
        self.accepted, self.promised = 1.0, 1.0  # decayed sums: kappa = accepted / promised, starting at 1

    def size(self, trees: list[DraftTree], greedy: list[bool]) -> tuple[list[DraftTree], float]:
        """The trees cut to the n that promises the most tokens per second (rows' own budgets kept), and the
        accepted nodes the kept ones promise (the round's `cut`)."""
        gains = [sorted((math.exp(s) for s in t.score[1:]), reverse=True) for t in trees]
        a, c = self.line.fit() if self.line.w else (1.0, None)
        c = a * self.PRIOR_SLOPE if c is None else c
        kappa = self.accepted / self.promised
        best, best_rate = 0, -1.0
        for n in range(min(self.most, max(len(g) for g in gains)) + 1):
            tokens = sum(1 + kappa * sum(g[:n]) for g in gains)
            rate = tokens / (a + c * max(min(n, len(g)) for g in gains))
            if rate > best_rate + 1e-12:
                best, best_rate = n, rate
        promise = sum(sum(g[:best]) for g in gains)
        return [rerank(t, best) if g else cut_path(t, best) for t, g in zip(trees, greedy)], promise

    def observe(self, record: RoundRecord) -> None:
        """A finished round: its widest row's verified nodes (k), its seconds, the drafts it accepted."""
        self.line.add(record.k, record.seconds)
        self.accepted = 0.9 * self.accepted + sum(record.accepted)
        self.promised = 0.9 * self.promised + max(record.cut or 0.0, 1e-3)


def cut_path(tree: DraftTree, n: int) -> DraftTree:
    """A tree cut after its first n drafted nodes (a path: its point-mass q kept, still exact; any tree whose nodes
    come after their parents: a tree of the first n)."""
    if tree.size <= n:
        return tree
    return DraftTree(tree.tokens[:n + 1], tree.parent[:n + 1], tree.depth[:n + 1], tree.score[:n + 1],
                     tree.path[:n + 1], {p: [c for c in kids if c <= n] for p, kids in tree.children.items() if p < n},
                     {node: q for node, q in tree.q.items() if node < n}, tree.fixed)


PLAIN, VERIFY, WHOLE = "plain", "verify", "lookahead"


class LookaheadGate:
    """k auto for lookahead decoding: each round verifies every row's whole tree (both branches), only its
    verification branch (the pool's n-grams: a narrower pass, the lanes wait) or only its pending token (a plain
    step), whichever promises the most tokens per second.

    A round's seconds are priced as a + c * width, the width its widest row's verified nodes (`CostLine` over every
    round of this batch size, plain rounds at width 0; until two widths were seen the slope is PRIOR_SLOPE * a).
    What a round yields is learned per level: the decayed mean of drafts accepted per row (whole trees) or per row
    that had n-grams to verify (the verification branch; a row without them gets none), from PRIOR_GAIN on. Tokens
    per second of a level: the rows' expected tokens over its priced seconds; plain decoding's: the rows over a.
    A batch size's first round is a plain step, so that the line has its intercept measured.
    While plain steps win, the whole tree is verified every `gap` rounds all the same (gap doubling from PROBE_GAP
    up to PROBE_GAP_MAX each time the probe did not win, back to PROBE_GAP when it did), so a pass that costs more
    than it buys, as a wide pass does on a small CPU, is paid for rarely. One gate per model: calls reuse what
    earlier calls measured. Cutting a tree keeps a tree of the same candidates, so every round stays exact."""

    PRIOR_SLOPE = 0.05  # a verified node's seconds as a share of a one-token pass, until measured
    PRIOR_GAIN = 1.0  # drafts accepted per row, until measured: high enough that each level gets tried
    PROBE_GAP, PROBE_GAP_MAX = 16, 512

    def __init__(self, decay: float = 0.9):
        self.decay = decay
        self.lines: dict[int, CostLine] = {}
        self.gain = {VERIFY: self.PRIOR_GAIN, WHOLE: self.PRIOR_GAIN}
        self.gap, self.since = self.PROBE_GAP, 0  # rounds since the whole tree was last verified
        self.plain_seen: set[int] = set()  # batch sizes whose plain steps were measured

    def size(self, trees: list[DraftTree], greedy: list[bool]) -> tuple[list[DraftTree], "GateCut"]:
        """Every row's tree cut to the level that promises the most tokens per second (greedy and sampled alike),
        and that choice (the round's `cut`)."""
        guesses = [getattr(t, "guesses", t.size) for t in trees]
        widths = {PLAIN: 0, VERIFY: max(guesses), WHOLE: max(t.size for t in trees)}
        rows, hit = len(trees), sum(1 for g in guesses if g)
        tokens = {PLAIN: rows, VERIFY: rows + hit * self.gain[VERIFY], WHOLE: rows * (1 + self.gain[WHOLE])}
        line = self.lines.setdefault(rows, CostLine(self.decay))
        a, c = line.fit() if line.w else (1.0, None)
        c = a * self.PRIOR_SLOPE if c is None else c
        rate = {level: tokens[level] / (a + c * widths[level]) for level in (PLAIN, VERIFY, WHOLE)
                if level == PLAIN or widths[level]}
        best = max(rate, key=lambda level: rate[level] + (1e-12 if level == PLAIN else 0.0))
        if rows not in self.plain_seen:  # a batch size's first round measures a plain step, the price of the rest
            best = PLAIN
            self.plain_seen.add(rows)
        self.since += 1
        probing = best == PLAIN and WHOLE in rate and self.since >= self.gap
        cut = GateCut(WHOLE if probing else best, rows, hit, probing)
        if cut.level == WHOLE:
            self.since = 0
            return trees, cut
        keep = {PLAIN: [0] * rows, VERIFY: guesses}[cut.level]
        return [cut_path(t, n) for t, n in zip(trees, keep)], cut

    def observe(self, record: RoundRecord) -> None:
        """A finished round: its widest row's verified nodes (k), its seconds, the drafts it accepted."""
        cut, width, seconds, accepted = record.cut, record.k, record.seconds, sum(record.accepted)
        self.lines.setdefault(cut.rows, CostLine(self.decay)).add(width, seconds)
        if cut.level == PLAIN or not width:
            return
        per = accepted / max(1, cut.hit if cut.level == VERIFY else cut.rows)
        self.gain[cut.level] = self.decay * self.gain[cut.level] + (1 - self.decay) * per
        if cut.probing:
            whole_wins = (cut.rows + accepted) / seconds > cut.rows / self.lines[cut.rows].fit()[0]
            self.gap = self.PROBE_GAP if whole_wins else min(2 * self.gap, self.PROBE_GAP_MAX)


@dataclass(frozen=True)
class GateCut:
    """A gated round: the level its trees were cut to, its rows, the rows with n-grams to verify, and
    whether it probes the whole tree while plain steps win."""

    level: str
    rows: int
    hit: int
    probing: bool


def make_planner(engine: Engine, k: int | str, stop_below: float) -> Planner:
    """The planner for chain rounds of this engine: fixed k, or one adaptive policy per engine and settings,
    so a call starts from what earlier calls learned."""
    if k != "auto":
        return Planner(k, stop_below)
    arms = engine.drafter.arms
    # a drafter whose first rounds for a row pay its prefill must promise more than plain decoding
    margins = {name: MIN_GAIN_LAZY_PREFILL if d.method.lazy_prefill else 1.0 for name, d in arms.items()}
    # with early stops, chains end where the policy prices one more draft above what it gains
    stop_arms = tuple(name for name, d in arms.items() if d.method.stops) if stop_below else ()
    k_max = auto_k_max(engine.k)
    policy = engine.policy((AdaptiveK, k_max, tuple(margins.items()), stop_arms),
                           lambda: AdaptiveK(k_max, min_gain=margins, arms=tuple(arms), stop_arms=stop_arms))
    policy.forget_rows()
    return AdaptivePlanner(policy, engine.drafter)
