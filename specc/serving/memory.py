"""Giving freed memory back to the system.

glibc's malloc keeps the heap of freed large buffers (a long prompt's logits, a compiled grammar) as its own
free lists, so the process stays as large as its peak; `malloc_trim` returns what it can. Elsewhere (musl,
macOS) it is a no-op.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


def trim() -> bool:
    """Return freed heap memory to the system; whether anything was returned."""
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False
