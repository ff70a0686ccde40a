"""Where specc keeps converted models and other reusable artefacts (never inside the repo)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """`$SPECC_CACHE`, else `$XDG_CACHE_HOME/specc`, else `~/.cache/specc`."""
    if env := os.environ.get("SPECC_CACHE"):
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specc"


def cache_dir(*parts: str) -> Path:
    path = cache_root().joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path
