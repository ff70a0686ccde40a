"""File digests (bundle verification, model downloads and caches)."""
from __future__ import annotations

import hashlib
from pathlib import Path


def sha256_of(path: Path, chunk: int = 1 << 22) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
