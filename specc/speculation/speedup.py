"""The yield of a speculative round, shared by `specc tune`'s predictions and adaptive k."""
from __future__ import annotations


def expected_tokens(alpha: float, k: int) -> float:
    """Mean tokens a chain round of k drafts yields at per-token acceptance alpha: the accepted
    drafts plus the target's own token, (1 - alpha^(k+1)) / (1 - alpha)."""
    return float(k + 1) if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)
