"""Adaptive speculation (k "auto"): choose each round's chain length from what was measured so far.

Each round the policy predicts, for every k in [0, k_max], the batch's tokens per second:

    throughput(k) = sum over rows b of tokens_b(k)  /  T(B, k)

- tokens_b(k) = h_b E(alpha_b, k) + (1 - h_b), with E the expected tokens of a round of k drafts
  (`specc tune`'s formula, Leviathan et al. 2023), alpha_b the row's per-token acceptance over
  its recent rounds (smoothed towards the acceptance of all rows, so new rows start from it) and
  h_b the fraction of its recent rounds that had a draft at all (prompt lookup may find none).
  k = 0 is plain decoding: 1 token per row.
- T(B, k): measured seconds of a whole round (drafting, the target pass, host work) at batch
  size B and chain length k, a moving average. Until a (B, k) has been measured it is estimated
  with `specc tune`'s cost model, T(B, k) = T(B, 0) (1 + s k) + k c_d(B): the verify pass grows by
  a fitted fraction s of a decode step per drafted token, c_d is the measured cost of one draft
  step, and a batch size not yet seen borrows from the nearest one that was.

The best k runs. A batch size never seen before first runs one plain round (the baseline of the
estimates), and every `probe_every`-th round runs a neighbour of the best k instead (while k = 0
wins: the best k >= 1), so acceptance and costs that change are noticed. The choice depends only on rounds that are
finished (their accepted counts and timings), never on the current round's drafts or noise, so
each round is an ordinary lossless speculative round: greedy output is the target's and sampled
output has the target's distribution whatever sequence of k the policy picks.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..limits import MAX_K

AUTO_K_MAX = 8  # k "auto" considers k up to max(the recipe's k, this)


def auto_k_max(recipe_k: int) -> int:
    """The largest k the policy considers for a bundle compiled with speculation.k = recipe_k."""
    return min(max(recipe_k, AUTO_K_MAX), MAX_K)



def expected_tokens(alpha: float, k: int) -> float:
    """Mean tokens a round of k drafts yields at per-token acceptance alpha (as in `specc tune`)."""
    return float(k + 1) if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)


@dataclass
class RoundRecord:
    """What one finished round did, as the Scheduler reports it (`Scheduler.last_round`)."""

    rows: list[int]  # request index of each batch row
    k: int  # chain length asked for (0: plain decode)
    n_draft: list[int]  # drafts each row proposed (<= k; prompt lookup may find fewer)
    n_accepted: list[int]
    draft_seconds: float
    target_seconds: float
    seconds: float  # the whole round, host work included (admission/prefill excluded)


@dataclass
class _Row:
    rounds: deque = field(default_factory=lambda: deque(maxlen=16))  # (accepted, judged, had_draft)


class AdaptiveK:
    """Chooses k per round; feed it every finished round with `observe`."""

    def __init__(self, k_max: int, window: int = 16, probe_every: int = 24, ema: float = 0.3,
                 prior_alpha: float = 0.5, prior_weight: float = 4.0, verify_slope: float = 0.25):
        if not isinstance(k_max, int) or not 1 <= k_max <= MAX_K:
            raise ValueError(f"k_max must be in [1, {MAX_K}], got {k_max!r}")
        self.k_max, self.window, self.probe_every, self.ema = k_max, window, probe_every, ema
        self.prior_weight = prior_weight
        self.alpha = prior_alpha  # acceptance of all rows (moving average): the prior of new rows
        self.hit_rate = 1.0
        self.prior_slope = verify_slope  # verify pass growth per drafted token, in decode steps ...
        self.slope: dict[int, float] = {}  # ... as measured at batch size B
        self.round_s: dict[tuple[int, int], float] = {}  # (B, k) -> seconds of a round
        self.draft_step_s: dict[int, float] = {}  # B -> seconds of one draft step
        self.rows: dict[int, _Row] = {}
        self.round_no = 0
        self.probe_up = False  # probes alternate between the best k - 1 and + 1
        self.chosen: list[int] = []  # k of every round so far (tests, metrics)

    # -- the decision -------------------------------------------------------------------
    def choose(self, rows: list[int]) -> int:
        """k for the next round of a batch whose rows are these request indices."""
        b = len(rows)
        self.round_no += 1
        if (b, 0) not in self.round_s and not any(bb == b for bb, _ in self.round_s):
            best = 0  # a batch size never seen: measure plain decoding first, the baseline of every estimate
        else:
            rates = {k: self.predicted_throughput(rows, k) for k in range(self.k_max + 1)}
            best = max(rates, key=rates.get)
            if self.round_no % self.probe_every == 0:  # keep the estimates around the best k fresh
                if best == 0:
                    best = max(range(1, self.k_max + 1), key=rates.get)
                else:
                    self.probe_up = not self.probe_up
                    best = min(best + 1, self.k_max) if self.probe_up else best - 1
        self.chosen.append(best)
        return best

    def predicted_throughput(self, rows: list[int], k: int) -> float:
        """Predicted tokens per second of the whole batch for a round of k drafts."""
        tokens = sum(self.row_tokens(r, k) for r in rows)
        return tokens / max(self.round_seconds(len(rows), k), 1e-9)

    def row_tokens(self, row: int, k: int) -> float:
        if k == 0:
            return 1.0
        alpha, hit = self.row_estimates(row)
        return hit * expected_tokens(alpha, k) + (1 - hit)

    def row_estimates(self, row: int) -> tuple[float, float]:
        """(alpha, hit rate) of a row: its recent rounds, smoothed towards all rows'."""
        state = self.rows.get(row)
        acc = judged = hits = n = 0
        if state is not None:
            for a, j, h in state.rounds:
                acc, judged, hits, n = acc + a, judged + j, hits + h, n + 1
        w = self.prior_weight
        alpha = (acc + w * self.alpha) / (judged + w)
        hit = (hits + w * self.hit_rate) / (n + w)
        return min(alpha, 0.99), hit

    def round_seconds(self, b: int, k: int) -> float:
        """Measured (or, not yet measured, modelled) seconds of a round at batch b and length k."""
        if (b, k) in self.round_s:
            return self.round_s[(b, k)]
        base = self._nearest(b, 0)
        if base is None:  # nothing measured at k = 0: start from any round, unscaled
            base = self._nearest(b, None) or 1.0
        slope = _nearest_value(self.slope, b, self.prior_slope)
        return base * (1 + slope * k) + k * _nearest_value(self.draft_step_s, b, 0.0)

    def _nearest(self, b: int, k: int | None) -> float | None:
        """Seconds of the measured round (at this k, or any) of the batch size nearest b, scaled to b."""
        seen = [(bb, kk) for (bb, kk) in self.round_s if k is None or kk == k]
        if not seen:
            return None
        bb, kk = min(seen, key=lambda key: (abs(key[0] - b), key[1]))
        return self.round_s[(bb, kk)] * (b / bb) ** 0.5

    # -- learning -------------------------------------------------------------------------
    def observe(self, record: RoundRecord) -> None:
        """Learn from a finished round (call before the next `choose`)."""
        b, k = len(record.rows), record.k
        self._average(self.round_s, (b, k), record.seconds)
        live = set(record.rows)
        self.rows = {r: s for r, s in self.rows.items() if r in live}
        if k == 0:
            return
        drafted = max(record.n_draft, default=0)
        if drafted:
            self._average(self.draft_step_s, b, record.draft_seconds / drafted)
        acc_all = judged_all = 0
        for row, d, n in zip(record.rows, record.n_draft, record.n_accepted):
            judged = n + (n < d)
            self.rows.setdefault(row, _Row(deque(maxlen=self.window))).rounds.append((n, judged, d > 0))
            acc_all, judged_all = acc_all + n, judged_all + judged
        if judged_all:
            self.alpha += self.ema * (acc_all / judged_all - self.alpha)
        self.hit_rate += self.ema * (sum(d > 0 for d in record.n_draft) / b - self.hit_rate)
        decode = self.round_s.get((b, 0))
        if decode and drafted:
            growth = max((record.seconds - record.draft_seconds) / decode - 1, 0.0) / drafted
            self._average(self.slope, b, growth)

    def _average(self, table: dict, key, value: float) -> None:
        table[key] = value if key not in table else table[key] + self.ema * (value - table[key])


def _nearest_value(table: dict[int, float], b: int, default: float) -> float:
    """The value measured at the batch size nearest b (default: nothing measured)."""
    return table[min(table, key=lambda x: (abs(x - b), x))] if table else default
