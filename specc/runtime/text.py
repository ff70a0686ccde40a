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
            hold = max((n for s in self.stop for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
            text = text[: len(text) - hold]
        delta = text[len(self.released):] if len(text) > len(self.released) else ""
        self.released += delta
        return delta, bool(hits)
