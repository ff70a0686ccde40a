"""Adaptive speculation (k "auto"): each round's arm and chain length from what was measured so far.

For every k in [0, k_max] and every arm (a way the drafter drafts, `Drafter.arms`) the policy predicts
the batch's tokens per second, tokens(k) / T(B, k), and plans the best (`AdaptiveK.choose` returns a
`DraftPlan`); every finished round's `RoundRecord` updates the estimates (`observe`). In short:

- tokens: per row, 1 + the expected accepted drafts, from the acceptance of draft i given drafts 1..i-1
  (per arm, per position, per class of drafts where the drafter tells them apart before drafting,
  `Drafter.finds`), the row's own acceptance of its first draft, and its hit rate (rows with drafts).
- T(B, k) = a_B + c_B * width: a cost line per batch size over recent rounds (plain rounds price k = 0),
  plus the catch-up an arm owes a row (`Drafter.behind`) spread over the row's remaining tokens.
- a margin (MIN_GAIN_LAZY_PREFILL) for arms that pay a draft prefill, early stops at the price of one
  more draft (`stop_threshold`), and probes that keep the estimates fresh: around the best k, of other
  arms, and of drafting at growing gaps while plain decoding wins (for a lone row, no more often than
  its catch-up fits PROBE_SHARE of the plain rounds' time).

The choice depends only on finished rounds and the context so far, never on the current round's noise,
so every round is an ordinary lossless round. docs/architecture.md ("k auto") has the whole model.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..limits import MAX_K
from .record import DraftPlan, RoundRecord


MIN_GAIN_LAZY_PREFILL = 1.1  # a draft model's catch-up pays only if it keeps drafting for the row (see above)
PLAIN_DECAY = 0.8  # plain rounds are measured now and then: weigh the recent ones
PLAIN_PROBE_WITHIN = 1.25  # while drafting wins, k = 0 is probed only where the best k promises less than this times it
MAX_STOP = 0.95  # a chain-probability threshold above this would end nearly every chain at its first draft
PROBE_SHARE = 0.05  # idle probes of a lone row spend at most this share of plain decoding's time on catch-ups


class CostLine:
    """Exponentially weighted least-squares fit of seconds = a + c * width."""

    def __init__(self, decay: float):
        self.decay = decay
        self.w = self.x = self.xx = self.y = self.xy = 0.0

    def add(self, width: float, seconds: float) -> None:
        d = self.decay
        self.w, self.x, self.xx = d * self.w + 1, d * self.x + width, d * self.xx + width * width
        self.y, self.xy = d * self.y + seconds, d * self.xy + width * seconds

    @property
    def spread(self) -> float:
        """Weighted variance of the widths seen (0: one width only, no slope)."""
        return self.xx / self.w - (self.x / self.w) ** 2

    def fit(self) -> tuple[float, float | None]:
        """(a, c); c is None until two different widths were seen."""
        if self.spread < 1e-3:
            return self.y / self.w, None
        c = (self.xy / self.w - self.x / self.w * self.y / self.w) / self.spread
        c = max(c, 0.0)
        return max(self.y / self.w - c * self.x / self.w, 1e-6), c


@dataclass
class _Arm:
    """What the policy learned about one way of drafting (an arm): acceptance and round costs."""

    judged: list[float]  # per draft position (1-based), decayed: rounds that reached it
    accepted: list[float]  # ... and accepted it
    hit_rate: float = 1.0
    lines: dict[int, CostLine] = field(default_factory=dict)  # batch size -> round seconds against width verified
    rows: dict[int, deque] = field(default_factory=dict)  # request index -> its recent (accepted, judged, had_draft)
    catch_up: list[float] = field(default_factory=lambda: [0.0, 0.0])  # decayed seconds, tokens of its catch-ups
    reach: dict[int, list[list[float]]] = field(default_factory=dict)  # batch size -> per position: rounds asked, verified
    classes: dict[int, tuple[list[float], list[float]]] = field(default_factory=dict)  # class -> its (judged, accepted)

    def catch_up_cost(self) -> float:
        """Seconds per token of context the arm takes in before drafting (0 until it has taken some in)."""
        seconds, tokens = self.catch_up
        return seconds / tokens if tokens else 0.0


class AdaptiveK:
    """Chooses k (and the arm) per round; feed it every finished round with `observe`."""

    def __init__(self, k_max: int, window: int = 16, probe_every: int = 16, probe_idle: int = 4,
                 probe_idle_max: int = 64, decay: float = 0.95, ema: float = 0.3,
                 prior_alpha: float = 0.5, prior_weight: float = 4.0, prior_slope: float = 0.25,
                 min_gain: float | dict[str, float] = 1.0, arms: tuple[str, ...] = ("draft",),
                 stop_arms: tuple[str, ...] = ()):
        if not isinstance(k_max, int) or not 1 <= k_max <= MAX_K:
            raise ValueError(f"k_max must be in [1, {MAX_K}], got {k_max!r}")
        self.k_max, self.window, self.decay, self.ema = k_max, window, decay, ema
        self.probe_every, self.probe_idle, self.probe_idle_max = probe_every, probe_idle, probe_idle_max
        self.arms, self.stop_arms = tuple(arms), tuple(stop_arms)
        self.min_gain = min_gain if isinstance(min_gain, dict) else {a: min_gain for a in self.arms}
        # (batch size, arm) -> rounds before its next idle probe (default probe_idle)
        self.idle_gap: dict[tuple[int, str], int] = {}
        self.prior_weight, self.prior_slope = prior_weight, prior_slope
        self.prior_alpha = prior_alpha
        self.stats = {a: _Arm([0.0] * (k_max + 1), [0.0] * (k_max + 1)) for a in self.arms}
        self.plain: dict[int, CostLine] = {}  # batch size -> seconds of its plain rounds (a decayed mean)
        self.plain_round: dict[int, int] = {}  # batch size -> the latest round that measured a plain one
        self.round_no = 0
        self.idle: dict[tuple[int, str], int] = {}  # (batch size, arm) -> rounds since the arm last drafted at that size
        self.probes = 0  # probes while drafting wins cycle through the best k + 1, k - 1, 0 and the other arms
        self.idle_probes = 0  # probes while k = 0 wins take the arms in turn
        self.chosen: deque[int] = deque(maxlen=4096)  # k of the latest rounds (tests)

    def forget_rows(self) -> None:
        """Drop what was learned per request (a new call numbers its requests from 0 again); what
        was learned about the drafter and the machine (acceptance by position, costs) stays."""
        for st in self.stats.values():
            st.rows.clear()

    # -- the decision -------------------------------------------------------------------
    def choose(self, rows: list[int], remaining: list[int] | None = None,
               behind: dict[str, list[int]] | None = None, finds: dict[str, list[int] | None] | None = None
               ) -> DraftPlan:
        """The plan of the next round of a batch whose rows are these request indices: its k (0: plain), arm
        and early-stop threshold; a probe (drafting only to measure) does not `take_in` rows, but for a lone row, which
        a probe that skipped it would measure nothing of.

        remaining: tokens each row may still generate; behind: per arm, tokens of each row the arm must
        take in before it drafts (`Drafter.behind`), priced over the rounds the row has left; finds: per
        arm, whether it will find drafts for each row this round and of which class (`Drafter.finds`), where
        it knows."""
        self.round_no += 1
        measuring, stop_below = False, 0.0
        best, arm = 0, self.arms[0]
        b = len(rows)
        # arms that would draft something this round (prompt lookup knows when it finds nothing: such a round
        # is a plain round, and neither wins nor probes as a drafting round)
        able = [a for a in self.arms if (finds or {}).get(a) is None or any(finds[a])]
        if able and (b in self.plain or any(b in st.lines for st in self.stats.values())):
            rates = {a: self.rates(rows, a, remaining, (behind or {}).get(a), (finds or {}).get(a)) for a in self.arms}
            plain = rates[arm][0]
            plain_seconds = b / plain
            # seconds of catch-up each arm owes these rows before it can draft for them (0 until it has measured one)
            owed = {a: self.stats[a].catch_up_cost() * sum((behind or {}).get(a) or ()) for a in self.arms}
            best_k = {a: max(range(1, self.k_max + 1), key=r.get) for a, r in rates.items()}
            # the arm whose best k promises the most over its margin (a gain within what its estimates leave out,
            # which a catch-up paid for rounds that then do not draft would lose); a lone row owing no more than a
            # plain round of catch-up needs none
            margin = {a: self.min_gain[a] if b > 1 or owed[a] > plain_seconds else 1.0 for a in self.arms}
            arm = max(able, key=lambda a: rates[a][best_k[a]] / margin[a])
            if rates[arm][best_k[arm]] >= margin[arm] * plain:
                best = best_k[arm]
            # plain decoding learns nothing: while k = 0 wins, an arm that has not drafted at this batch size for
            # its gap of rounds drafts once (other arms' drafting rounds do not count for it). A probe of a lone row
            # takes it in, so its catch-up must fit PROBE_SHARE of the plain rounds since the arm last drafted.
            due = [a for a in able if self.idle.get((b, a), 0) + 1 >= self.idle_gap.get((b, a), self.probe_idle)
                   and (b > 1 or owed[a] <= PROBE_SHARE * (self.idle.get((b, a), 0) + 1) * plain_seconds)]
            if best == 0 and due:
                arm = due[self.idle_probes % len(due)]
                best = best_k[arm]
                self.idle_probes += 1
                self.idle_gap[b, arm] = min(2 * self.idle_gap.get((b, arm), self.probe_idle), self.probe_idle_max)
                measuring = True
            elif best:
                self.idle_gap[b, arm] = self.probe_idle
                if self.round_no % self.probe_every == 0:  # keep the estimates around the best choice fresh
                    # (k = 0 only where no plain round was measured lately, prompt lookup that finds nothing makes
                    # them, and where plain decoding is near the best: a price far off cannot turn the choice)
                    fresh = self.round_no - self.plain_round.get(b, -self.probe_every) < self.probe_every
                    close = rates[arm][best] < PLAIN_PROBE_WITHIN * plain
                    options = [(arm, min(best + 1, self.k_max)), (arm, best - 1)] + [(arm, 0)] * (close and not fresh)
                    options += [(a, best_k[a]) for a in able if a != arm]
                    self.probes += 1
                    probe_arm, best = options[self.probes % len(options)]
                    measuring, arm = probe_arm != arm, probe_arm
            for a in self.arms:
                self.idle[b, a] = 0 if best and a == arm else self.idle.get((b, a), 0) + 1
            if best and arm in self.stop_arms:
                stop_below = self.stop_threshold(b, arm, rates[arm][best])
        # else: no arm drafts anything this round, or a batch size never seen: measure plain decoding first,
        # the price of k = 0
        self.chosen.append(best)
        return DraftPlan(best, arm, take_in=not measuring or b == 1, stop_below=stop_below, stop_chain=True)

    def rates(self, rows: list[int], arm: str | None = None, remaining: list[int] | None = None,
              behind: list[int] | None = None, finds: list[int] | None = None) -> dict[int, float]:
        """Predicted tokens per second of the whole batch for a round of k drafts, for every k in [0, k_max].

        A row the arm must first take `behind` tokens of (at the arm's measured seconds per token) pays
        for them over the rounds it has left (`remaining` tokens at this round's tokens per row): drafting
        for a row that is about to finish, or that plain rounds left far behind, is dearer than its round.
        `finds` (whether the arm will have drafts for each row this round, of which class) replaces the rows'
        hit rates, and each row's drafts are priced with the acceptance of their class."""
        classes = finds or [0] * len(rows)
        c = {cls: self.conditional(arm, cls) for cls in set(classes)}
        estimates = [self.row_estimates(r, c[cls][1], arm) for r, cls in zip(rows, classes)]
        if finds is not None:
            estimates = [(alpha, float(found > 0)) for (alpha, _), found in zip(estimates, finds)]
        miss = 1.0
        for _, h in estimates:
            miss *= 1 - h
        per_token = self.stats[arm or self.arms[0]].catch_up_cost()
        entry = list(zip(behind, remaining)) if behind and remaining and per_token else []
        out = {0: len(rows) / self.round_seconds(len(rows), 0.0, arm)}
        reach, after_first = dict.fromkeys(c, 1.0), dict.fromkeys(c, 0.0)
        for k in range(1, self.k_max + 1):
            for cls, chain in c.items():
                if k > 1:
                    reach[cls] *= chain[k]  # chance that drafts 2..k are accepted given the first was
                after_first[cls] += reach[cls]
            per_row = [h * (1 + alpha * after_first[cls]) + 1 - h for (alpha, h), cls in zip(estimates, classes)]
            catch_up = per_token * sum(lag * min(1.0, t / max(left, 1)) for (lag, left), t in zip(entry, per_row))
            width = self.drafted_width(len(rows), k, arm) * (1 - miss)
            out[k] = sum(per_row) / (self.round_seconds(len(rows), width, arm) + catch_up)
        return out

    def stop_threshold(self, b: int, arm: str, rate: float) -> float:
        """Where an arm of `stop_arms` ends a row's chain: once the chance that the whole chain is accepted
        (the product of its drafts' probabilities, `Stops(chain=True)`) is below what one more draft costs
        in tokens, i.e. the round's seconds per drafted position (draft step and verify column) times the
        tokens per second the round promises. A draft that is accepted with that chance gains tokens at the
        rate the round makes them, so drafting on pays exactly while the chance is above it."""
        per_position = self.round_seconds(b, 2.0, arm) - self.round_seconds(b, 1.0, arm)
        return min(max(per_position * rate, 0.0), MAX_STOP)

    def drafted_width(self, b: int, k: int, arm: str | None = None) -> float:
        """Drafts a round that asks for k verifies at batch size b: k, less where chains stop early (the
        share of rounds that asked for position i and verified it, per position, smoothed towards k)."""
        reach = self.stats[arm or self.arms[0]].reach.get(b)
        if reach is None:
            return float(k)
        asked, verified = reach
        return sum((verified[i] + 1) / (asked[i] + 1) for i in range(1, k + 1))

    def conditional(self, arm: str | None = None, cls: int = 0) -> list[float]:
        """c[i] for i in 1..k_max: acceptance of draft i given drafts 1..i-1 were accepted (c[0] unused), of
        the arm's drafts of class `cls` (`Drafter.finds`; smoothed towards all its drafts) or of all (0)."""
        st = self.stats[arm or self.arms[0]]
        judged, accepted, prior = st.judged, st.accepted, self.prior_alpha
        if cls in st.classes:
            (judged, accepted), prior = st.classes[cls], self.conditional(arm)[1]
        c, w = [1.0], self.prior_weight
        for i in range(1, self.k_max + 1):
            prior = min((accepted[i] + w * prior) / (judged[i] + w), 0.99)
            c.append(prior)
        return c

    def row_estimates(self, row: int, first: float | None = None, arm: str | None = None) -> tuple[float, float]:
        """(acceptance of the first draft, hit rate) of a row: its recent rounds, smoothed towards all rows'
        (`first`: all rows' acceptance of the first draft, if the caller has it)."""
        st = self.stats[arm or self.arms[0]]
        acc = judged = hits = n = 0
        for a, j, h in st.rows.get(row, ()):
            acc, judged, hits, n = acc + a, judged + j, hits + h, n + 1
        w = self.prior_weight
        alpha = (acc + w * (self.conditional(arm)[1] if first is None else first)) / (judged + w)
        hit = (hits + w * st.hit_rate) / (n + w)
        return min(alpha, 0.99), hit

    def round_seconds(self, b: int, width: float, arm: str | None = None) -> float:
        """Predicted seconds of a round at batch size b verifying `width` drafts per row; a plain
        round (width 0) at a batch size that ran plain rounds costs what they cost."""
        if width == 0 and b in self.plain:
            return self.plain[b].fit()[0]
        lines = self.stats[arm or self.arms[0]].lines
        if not lines:
            return (self.plain[b].fit()[0] if b in self.plain else 1.0) * (1.0 + self.prior_slope * width)
        near = min(lines, key=lambda x: (abs(x - b), x))
        a, c = lines[near].fit()
        if b != near:
            a *= (b / near) ** 0.5
        if c is None or b != near:
            c = a * self._slope_ratio(b, lines)
        return a + c * width

    def _slope_ratio(self, b: int, lines: dict[int, CostLine]) -> float:
        """c/a of the nearest batch size with a fitted slope (the prior if none has)."""
        fitted = [(x, line.fit()) for x, line in lines.items() if line.spread >= 1e-3]
        if not fitted:
            return self.prior_slope
        _, (a, c) = min(fitted, key=lambda item: (abs(item[0] - b), item[0]))
        return c / a

    # -- learning -------------------------------------------------------------------------
    def observe(self, record: RoundRecord) -> None:
        """Learn from a finished round (call before the next `choose`)."""
        b = len(record.rows)
        width = max(record.drafted, default=0) if record.k else 0
        arms = self.arms if width == 0 else (record.arm,)  # a plain round prices k = 0 for every arm
        for a in arms:
            self.stats[a].lines.setdefault(b, CostLine(self.decay)).add(width, record.seconds)
        if record.catch_up_tokens:
            cu = self.stats[record.arm].catch_up
            cu[0], cu[1] = self.decay * cu[0] + record.catch_up_seconds, self.decay * cu[1] + record.catch_up_tokens
        if width == 0:
            self.plain.setdefault(b, CostLine(PLAIN_DECAY)).add(0, record.seconds)
            self.plain_round[b] = self.round_no
        live = set(record.rows)
        for st in self.stats.values():
            st.rows = {r: s for r, s in st.rows.items() if r in live}
        skipped = set(record.skipped)
        if record.k == 0 or len(skipped) == b:
            return
        st = self.stats[record.arm]
        st.judged = [x * self.decay for x in st.judged]
        st.accepted = [x * self.decay for x in st.accepted]
        seen: dict[int, tuple[list[float], list[float]]] = {}  # this round's (judged, accepted) per class
        for j, (row, d, n) in enumerate(zip(record.rows, record.drafted, record.accepted)):
            if j in skipped:  # not drafted for: says nothing about acceptance or lookup hits
                continue
            st.rows.setdefault(row, deque(maxlen=self.window)).append((int(n > 0), int(d > 0), d > 0))
            cls = record.classes[j] if record.classes and d else 0
            counts = [(st.judged, st.accepted)]
            if cls:
                counts.append(seen.setdefault(cls, ([0.0] * (self.k_max + 1), [0.0] * (self.k_max + 1))))
            for judged, accepted in counts:
                for i in range(1, min(n + 1, d) + 1):  # drafts 1..n accepted, draft n+1 (if any) rejected
                    judged[i] += 1
                    accepted[i] += i <= n
                if record.stop_below and 0 < d == n < min(record.k, self.k_max):  # a chain that stopped early
                    judged[d + 1] += 1  # gains what a rejection of the next draft would
        for cls, (judged, accepted) in seen.items():  # a class ages only in the rounds that draft it
            old_judged, old_accepted = st.classes.get(cls, ([0.0] * (self.k_max + 1), [0.0] * (self.k_max + 1)))
            st.classes[cls] = ([self.decay * o + x for o, x in zip(old_judged, judged)],
                               [self.decay * o + x for o, x in zip(old_accepted, accepted)])
        if record.stop_below:
            asked, verified = st.reach.setdefault(b, [[0.0] * (self.k_max + 1), [0.0] * (self.k_max + 1)])
            for i in range(1, self.k_max + 1):
                asked[i], verified[i] = (self.decay * asked[i] + (i <= record.k),
                                         self.decay * verified[i] + (i <= min(width, record.k)))
        drafted = [d for j, d in enumerate(record.drafted) if j not in skipped]
        if drafted:
            st.hit_rate += self.ema * (sum(d > 0 for d in drafted) / len(drafted) - st.hit_rate)
