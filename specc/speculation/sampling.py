"""Sampling and the lossless acceptance rules, as plain tensor functions.

Every random choice takes its uniform noise as an argument (inverse-CDF sampling), so the
same functions run on the host and inside a graph (the verification-head pass), and give
identical results for identical noise.

Acceptance (Leviathan et al. 2023; Chen et al. 2023): draft token d_i ~ q_i is accepted
with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection the next token is
drawn from norm(max(0, p_i - q_i)); if every draft is accepted a bonus token is drawn from
p_{k}. The output is distributed exactly as the target's p. Greedy is the special case
of one-hot p and q: accept while the draft equals the target's argmax.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from ..errors import RequestError


MAX_TEMPERATURE = 100.0  # the recipe's sampling.temperature range
MAX_TOP_K = 2**31 - 1
FLOAT32_TINY = float(torch.finfo(torch.float32).tiny)


def _is_number(value) -> bool:
    """A finite real number (bools and NaN/infinity excluded)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> "SamplingParams":
        t, k, p = self.temperature, self.top_k, self.top_p
        if not _is_number(t) or not 0 <= t <= MAX_TEMPERATURE:
            raise RequestError(f"temperature must be a number in [0, {MAX_TEMPERATURE:g}] (0 = greedy), got {t!r}")
        if not (isinstance(k, numbers.Integral) and not isinstance(k, bool)) or not 0 <= k <= MAX_TOP_K:
            raise RequestError(f"top_k must be an integer in [0, {MAX_TOP_K}] (0 = off), got {k!r}")
        if not _is_number(p) or not 0 < p <= 1:
            raise RequestError(f"top_p must be a number in (0, 1] (1 = off), got {p!r}")
        return self


@dataclass
class RowParams:
    """Per-row sampling settings of a batch as tensors ([B] each); rows may differ."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor

    @classmethod
    def of(cls, params: list[SamplingParams], device=None) -> "RowParams":
        return cls(
            torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
            # float32 turns a top_p below ~7e-46 into 0; the smallest normal float keeps the same nucleus (the
            # most likely token), also in verification heads compiled before probs_from_logits kept it itself
            torch.tensor([max(p.top_p, FLOAT32_TINY) for p in params], dtype=torch.float32, device=device),
        )

    @property
    def greedy(self) -> torch.Tensor:
        return self.temperature == 0

    @property
    def all_greedy(self) -> bool:
        return bool(self.greedy.all())


def probs_from_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor) -> torch.Tensor:
    """Temperature, then top-k, then top-p, per row: logits [B, ..., V], settings [B].

    float32 probabilities. Greedy rows (temperature 0) get a finite but meaningless
    distribution; callers take the argmax for them.
    """
    shape = (-1,) + (1,) * (logits.dim() - 1)
    logits = logits.float() / temperature.clamp(min=1e-6).view(shape)
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab)).view(shape)
    kth = sorted_logits.gather(-1, (k - 1).expand(*sorted_logits.shape[:-1], 1))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    sorted_p = torch.softmax(sorted_logits, dim=-1)
    before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly above each token
    # the most likely token (before == 0 exactly) is always kept: a top_p that underflows float32 to 0
    # would otherwise drop every token and leave 0/0
    sorted_p = sorted_p.masked_fill((before >= top_p.view(shape)) & (before > 0), 0.0)
    sorted_p = sorted_p / sorted_p.sum(-1, keepdim=True)
    return torch.zeros_like(sorted_p).scatter(-1, order, sorted_p)


def sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: the first token whose cumulative mass exceeds u * total; u in [0, 1).

    Written as a count of cumulative values at or below the target (not searchsorted), so the
    same code exports to ONNX inside the verification head.
    """
    cdf = torch.cumsum(probs, dim=-1)
    target = (u * cdf[..., -1]).unsqueeze(-1)
    idx = (cdf <= target).sum(-1)
    return idx.clamp(max=probs.shape[-1] - 1)


def _leading(ok: torch.Tensor) -> torch.Tensor:
    """Number of leading True per row of a [B, k] bool tensor (no cumprod: it must export to ONNX)."""
    return (torch.cumsum((~ok).to(torch.int64), dim=-1) == 0).sum(-1)


def choose(logits: torch.Tensor, params: RowParams, u: torch.Tensor):
    """Next token per row from logits [B, V]: argmax for greedy rows, an inverse-CDF draw with
    noise u [B] for the others. Returns (tokens [B], probs [B, V] or None if all rows are greedy)."""
    best = logits.argmax(-1)
    if params.all_greedy:
        return best, None
    probs = probs_from_logits(logits, params.temperature, params.top_k, params.top_p)
    return torch.where(params.greedy, best, sample(probs, u)), probs


def accept_greedy(target_logits: torch.Tensor, draft_tokens: torch.Tensor, n_draft: torch.Tensor):
    """Greedy acceptance. target_logits [B, k+1, V], draft_tokens [B, k], n_draft [B] valid drafts.

    Returns (n_accepted [B], next_token [B]): the target's argmax after the accepted prefix.
    """
    k = draft_tokens.shape[1]
    best = target_logits.argmax(-1)  # [B, k+1]
    valid = torch.arange(k, device=draft_tokens.device)[None, :] < n_draft[:, None]
    n_acc = _leading((best[:, :k] == draft_tokens) & valid)
    return n_acc, best.gather(1, n_acc[:, None]).squeeze(1)


def accept_sampled(p: torch.Tensor, q: torch.Tensor, draft_tokens: torch.Tensor, n_draft: torch.Tensor,
                   u_accept: torch.Tensor, u_next: torch.Tensor):
    """Modified rejection sampling. p [B, k+1, V] target probs, q [B, k, V] draft probs
    (rows past n_draft ignored), draft_tokens [B, k], u_accept [B, k], u_next [B].

    Returns (n_accepted [B], next_token [B]) with next ~ norm(max(0, p - q)) at the first
    rejection, or ~ p at position n_draft when every draft was accepted.
    """
    b, k = draft_tokens.shape
    valid = torch.arange(k, device=p.device)[None, :] < n_draft[:, None]
    p_d = p[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)
    q_d = q.gather(-1, draft_tokens[..., None]).squeeze(-1)
    n_acc = _leading((u_accept * q_d < p_d) & valid)
    q_pad = torch.cat([q * valid[..., None], torch.zeros_like(p[:, :1])], dim=1)  # zero past the drafts
    rows = torch.arange(b, device=p.device)
    p_n, q_n = p[rows, n_acc], q_pad[rows, n_acc]
    residual = torch.clamp(p_n - q_n, min=0.0)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 1e-12, residual / mass.clamp(min=1e-30), p_n)
    return n_acc, sample(residual, u_next)


def accept(target_logits: torch.Tensor, q: torch.Tensor | None, draft_tokens: torch.Tensor, n_draft: torch.Tensor,
           params: RowParams, u_accept: torch.Tensor, u_next: torch.Tensor):
    """Acceptance for a batch whose rows may be greedy or sampled: (n_accepted [B], next_token [B])."""
    n_g, next_g = accept_greedy(target_logits, draft_tokens, n_draft)
    if params.all_greedy:
        return n_g, next_g
    p = probs_from_logits(target_logits, params.temperature, params.top_k, params.top_p)
    n_s, next_s = accept_sampled(p, q, draft_tokens, n_draft, u_accept, u_next)
    return torch.where(params.greedy, n_g, n_s), torch.where(params.greedy, next_g, next_s)
