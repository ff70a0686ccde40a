"""A deterministic stand-in for the adaptive policy, shared by the tests that run k "auto"."""
from __future__ import annotations

import itertools

from specc.runtime.adaptive import AdaptiveK
from specc.runtime.record import DraftPlan


class FlippingK(AdaptiveK):
    """A policy that changes k every round (0 included), in a fixed pseudo-random order; some of its
    drafting rounds are idle probes (a draft model skips rows whose context it has not taken in), and it
    takes the drafter's arms in turn."""

    def __init__(self, k_max: int, **kwargs):
        super().__init__(k_max, **kwargs)
        self.order = itertools.cycle([3, 0, 1, 4, 2, 0, 4, 1, 1, 3, 0, 2])
        self.probes = itertools.cycle([False, True, False, True, False])
        self.arm_order = itertools.cycle(range(5))
        self.thresholds = itertools.cycle([0.3, 0.6, 0.9, 0.1])  # chain-probability stops, where enabled

    def choose(self, rows, remaining=None, behind=None, finds=None):
        k = min(next(self.order), self.k_max)
        measuring = bool(k) and next(self.probes)
        arm = self.arms[next(self.arm_order) % len(self.arms)]  # lookup first: lookup-only rounds too
        stop_below = next(self.thresholds) if k and arm in self.stop_arms else 0.0
        self.chosen.append(k)
        return DraftPlan(k, arm, take_in=not measuring or len(rows) == 1, stop_below=stop_below, stop_chain=True)


def admit(scheduler) -> list:
    """Prefill the requests the scheduler admits next, whole, and let them join its batch; their first events."""
    prefill = scheduler._admit()
    prefill.run()
    return scheduler._join(prefill)
