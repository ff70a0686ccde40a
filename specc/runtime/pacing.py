"""Pacing a long prompt's prefill beside decoding rows (`Scheduler.step`).

Beside decoding rows a prompt takes about SHARE of their time: a chunk runs only once the rounds since the
last one have paid for it, so the rows' mean time between tokens stays within 1 + SHARE rounds, well inside
what a chat user barely notices. Each chunk is sized to cost about ROUNDS rounds: a larger chunk pays a
pass's fixed cost (the weights, attention over the cache so far) less often, so the long prompt moves faster
at the same share, and a decoding row's longest gap stays near 1 + ROUNDS rounds.
"""
from __future__ import annotations

START = 32  # tokens of the first chunk beside decoding rows, before any was timed
MIN = 4  # fewest tokens of a chunk
SHARE = 1.5  # the prompt's time as a share of the decoding rows'
ROUNDS = 4.0  # what one chunk costs, in rounds


class Pacing:
    """When a chunk of prompt runs beside decoding rows, and how many tokens it holds."""

    def __init__(self):
        self.round_s: float | None = None  # a round's seconds (moving average)
        self.token_s: float | None = None  # the last chunk's seconds per prompt token
        self.tokens = START  # the last chunk's tokens
        self.credit = 0.0  # seconds of prefill the rows' rounds have paid for, less the chunks' own

    @property
    def due(self) -> bool:
        """The rounds since the last chunk have paid for the next."""
        return self.credit >= 0

    def chunk_size(self, most: int, prefill_chunk: int) -> int:
        """Prompt tokens of the next chunk: as many as cost about ROUNDS rounds at the last chunk's seconds per
        token. That cost per token includes the pass's fixed part, so a chunk that ran under its budget grows
        the next one and one that ran over shrinks it, to the size whose pass takes the budget (within a factor
        of two per step, between MIN and `most`, and never above a prefill chunk)."""
        if self.round_s is None or self.token_s is None:
            size = min(most, START)
        else:
            size = int(ROUNDS * self.round_s / self.token_s)
            size = max(self.tokens // 2, min(2 * self.tokens, size))
        self.tokens = max(min(MIN, most), min(most, prefill_chunk, size))
        return self.tokens

    def chunk_ran(self, seconds: float, tokens: int) -> None:
        self.token_s = seconds / max(1, tokens)
        self.credit -= seconds

    def round_ran(self, seconds: float) -> None:
        self.round_s = seconds if self.round_s is None else 0.8 * self.round_s + 0.2 * seconds
        self.credit = min(0.0, self.credit + SHARE * seconds)  # no savings: a chunk never bursts

    def idle(self) -> None:
        """No rows decode: what the prompt owed was owed to rows that have left."""
        self.credit = 0.0
