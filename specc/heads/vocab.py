"""Reduced draft vocabularies (EAGLE-3 style): a drafter predicts V' frequent tokens, mapped back to
the target's vocabulary inside the graph. Logits outside the draft vocabulary are the float32
minimum, so q is exactly zero there and rejection sampling stays exact.

`frequent_tokens` picks V' for a draft model's LM head (recipe draft.vocab) by counting tokens in
text: by default the source of some standard-library modules (none of the benchmark's) and Python's
documentation topics, i.e. code and English prose; `draft.vocab_text` names text closer to the traffic.
"""
from __future__ import annotations

import importlib
import inspect
from collections import Counter
from pathlib import Path
from typing import Iterable

import torch
from torch import nn

from ..errors import RecipeError

NEG = torch.finfo(torch.float32).min

# code and English prose from the standard library: disjoint from the benchmark's modules (bench/prompts.py)
CORPUS_MODULES = ("pydoc_data.topics", "argparse", "collections", "dataclasses", "datetime", "enum", "functools",
                  "inspect", "logging", "os", "random", "re", "shutil", "subprocess", "tarfile", "threading",
                  "typing", "unittest.case", "urllib.parse", "zipfile", "email.message", "http.client", "sqlite3",
                  "asyncio.tasks", "concurrent.futures._base", "contextlib", "decimal", "gettext", "tokenize")
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".py", ".json", ".jsonl", ".js", ".ts", ".c", ".h", ".cpp", ".java", ".go",
                 ".rs", ".html", ".css", ".sh", ".yaml", ".yml", ".toml", ".sql")
CHUNK = 1 << 16  # characters tokenised at a time (byte-level BPE pre-tokenisation is slow on huge strings)


class VocabMap(nn.Module):
    """Reduced draft vocabulary → full-vocabulary logits (minimum float outside the draft vocabulary)."""

    def __init__(self, draft_vocab: torch.Tensor | None, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.register_buffer("draft_vocab", None if draft_vocab is None else draft_vocab.long().clone())

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        if self.draft_vocab is None:
            return logits
        full = torch.full((*logits.shape[:-1], self.vocab_size), NEG, dtype=logits.dtype, device=logits.device)
        index = self.draft_vocab.expand(*logits.shape[:-1], -1)
        return full.scatter(-1, index, logits)


def corpus_texts(paths: Iterable[str] = ()) -> tuple[list[str], str]:
    """The texts a draft vocabulary is counted on, and a line naming them: the files under `paths` (files, or
    directories searched for TEXT_SUFFIXES), or CORPUS_MODULES' source when none are given."""
    paths = list(paths)
    if not paths:
        texts = [inspect.getsource(importlib.import_module(name)) for name in CORPUS_MODULES]
        return texts, f"standard-library source and documentation ({len(CORPUS_MODULES)} modules)"
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES)
        elif p.is_file():
            files.append(p)
        else:
            raise RecipeError("draft.vocab_text", f"{p} is neither a file nor a directory")
    texts = []
    for f in files:
        try:
            texts.append(f.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as e:
            raise RecipeError("draft.vocab_text", f"{f} is not readable UTF-8 text ({e.__class__.__name__})") from None
    if not any(t.strip() for t in texts):
        raise RecipeError("draft.vocab_text", f"no text found in {', '.join(paths)} (files, or directories holding "
                                              f"{', '.join(TEXT_SUFFIXES[:6])}, ...)")
    return texts, f"{len(files)} file(s) of draft.vocab_text"


def frequent_tokens(tokenizer, size: int, texts: Iterable[str], keep: Iterable[int] = ()) -> tuple[torch.Tensor, dict]:
    """The `size` token ids most frequent in `texts` (ties: the lower id, BPE's earlier merge), always
    including `keep` (special tokens: end of sequence, chat markers); sorted ids and what was counted
    (tokens, distinct tokens, the share of counted tokens inside the vocabulary)."""
    counts: Counter = Counter()
    for text in texts:
        for lo in range(0, len(text), CHUNK):
            counts.update(tokenizer(text[lo:lo + CHUNK], add_special_tokens=False)["input_ids"])
    keep = sorted(set(int(i) for i in keep))
    ranked = keep + [t for t, _ in sorted(counts.items(), key=lambda tc: (-tc[1], tc[0])) if t not in set(keep)]
    vocab_size = len(tokenizer)
    chosen = set(ranked[:size])
    if len(chosen) < size:  # too little text: the lowest remaining ids fill it
        chosen.update(i for i in range(vocab_size) if i not in chosen)
        chosen = set(sorted(chosen, key=lambda i: (i not in counts, i))[:size])
    total = sum(counts.values())
    inside = sum(c for t, c in counts.items() if t in chosen)
    info = {"counted_tokens": total, "distinct_tokens": len(counts), "coverage": round(inside / total, 6) if total else 0.0}
    return torch.tensor(sorted(chosen), dtype=torch.long), info
