"""Statistical checks shared by the sampling-losslessness tests."""
from __future__ import annotations

import numpy as np
from scipy.stats import chisquare

PASS_P = 1e-3  # a correct rule must not be rejected at this level (fixed seeds: deterministic)
FAIL_P = 1e-6  # a broken rule must be rejected at this level


def chi2_pvalue(samples, probs) -> float:
    """Chi-square goodness of fit of integer samples to a distribution; cells with tiny
    expectation are pooled so the test's approximation holds."""
    probs = np.asarray(probs, dtype=np.float64)
    probs = probs / probs.sum()
    counts = np.bincount(np.asarray(samples), minlength=len(probs)).astype(np.float64)
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        if obs[-1] > 0:
            return 0.0  # samples where the distribution has no mass
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs, exp).pvalue)


def total_variation(samples, probs) -> float:
    probs = np.asarray(probs, dtype=np.float64)
    counts = np.bincount(np.asarray(samples), minlength=len(probs)) / len(samples)
    return 0.5 * float(np.abs(counts - probs / probs.sum()).sum())
