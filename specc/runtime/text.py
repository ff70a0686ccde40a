"""Incremental detokenisation with stop strings: release only text that can no longer change."""
from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer, self.stop = tokenizer, stop
        self.released = ""

    def stop_end(self, token_ids: list[int], start: int) -> int:
        """The fewest tokens, at least `start`, whose text holds a stop string (len(token_ids) if none does)."""
        for n in range(start, len(token_ids)):
            text = self.tokenizer.decode(token_ids[:n], skip_special_tokens=True)
            if any(s in text for s in self.stop):
                return n
        return len(token_ids)

    def update(self, token_ids: list[int], final: bool) -> tuple[str, bool]:
        """New text since the last call, and whether a stop string ended the row.

        Held back until final: a trailing partial UTF-8 character, and a suffix that could
        still grow into a stop string.
        """
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            text, final = text[: min(hits)], True
        if not final:
            text = text.rstrip("\ufffd")
            hold = max((_overlap(text, s) for s in self.stop), default=0)
            text = text[: len(text) - hold]
        delta = text[len(self.released):] if len(text) > len(self.released) else ""
        self.released += delta
        return delta, bool(hits)


def _overlap(text: str, stop: str) -> int:
    """Length of the longest proper prefix of `stop` that `text` ends with (0: none).

    Only the last len(stop) - 1 characters of text can take part, and each candidate start is a place
    where stop's first character occurs, so the work is bounded by the stop string's length, not by
    the square of it (a long stop string is checked after every round of every row)."""
    tail = text[len(text) - min(len(stop) - 1, len(text)):]
    start = tail.find(stop[0]) if tail else -1
    while start >= 0:
        if stop.startswith(tail[start:]):
            return len(tail) - start
        start = tail.find(stop[0], start + 1)
    return 0
