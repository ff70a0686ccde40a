"""The prefix cache: target KV of token prefixes already computed, shared across requests and turns.

Like vLLM's automatic prefix caching: a prompt is cut into blocks of BLOCK tokens, and block i is
keyed by a hash of every token up to its end (the previous block's key and its own tokens), so a
key names the whole prefix, not just the block. A request whose prompt starts with blocks already
cached copies their KV into its cache row and prefills only the rest. Blocks are kept in LRU order
under a byte budget; blocks are written when a prompt has been prefilled and when a request finishes
(its prompt and generated tokens: a chat's next turn starts with them).

Only the target's KV is kept. A draft model's cache catches up lazily from the tokens (its
prefill is chunked and cheap next to the target's); an early-exit draft reads the target's cache;
an EAGLE head needs the target's features of every prompt token, so bundles with EAGLE do not use
the cache (its method row's `prompt_features`, also behind a front drafter).
"""
from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict

import torch

BLOCK = 64  # tokens per cached block: a chat turn's prefix is reused up to its last whole block


def block_keys(tokens: list[int], n_blocks: int, domain: bytes = b"") -> list[bytes]:
    """The keys of the first n_blocks whole blocks of tokens (each names the whole prefix up to its end, in
    its isolation domain: a prefix stored in one domain is never found from another)."""
    keys, prev = [], hashlib.blake2b(domain, digest_size=16).digest() if domain else b""
    for i in range(n_blocks):
        chunk = array("q", tokens[i * BLOCK:(i + 1) * BLOCK]).tobytes()
        prev = hashlib.blake2b(prev + chunk, digest_size=16).digest()
        keys.append(prev)
    return keys


class PrefixCache:
    """Target KV blocks `[L, H, BLOCK, D]` keyed by their token prefix; LRU under `budget_bytes` (0: off).

    Thread-safe: `specc serve` scrapes its counters from another thread than the engine's."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = max(0, int(budget_bytes))
        self.blocks: OrderedDict[bytes, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self.bytes = 0
        self.queries = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.hits = 0  # of which were found (vLLM's prefix_cache_hits)
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def match(self, tokens: list[int], domain: bytes = b"") -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The cached blocks that start `tokens` in `domain`, longest first run of them; at least one token
        is left uncached, since the prefill must compute the last prompt token's logits."""
        if not self.enabled:
            return []
        found = []
        with self._lock:
            for key in block_keys(tokens, (len(tokens) - 1) // BLOCK, domain):
                block = self.blocks.get(key)
                if block is None:
                    break
                self.blocks.move_to_end(key)
                found.append(block)
            self.queries += len(tokens)
            self.hits += len(found) * BLOCK
        return found

    def store(self, tokens: list[int], k: torch.Tensor, v: torch.Tensor, domain: bytes = b"") -> None:
        """Keep the whole blocks of one row's committed KV in `domain`: k, v `[L, H, S, D]` hold tokens[:S]."""
        if not self.enabled:
            return
        n = min(len(tokens), k.shape[2]) // BLOCK
        keys = block_keys(tokens, n, domain)
        with self._lock:
            for i, key in enumerate(keys):
                if key in self.blocks:
                    self.blocks.move_to_end(key)
                    continue
                block = (k[:, :, i * BLOCK:(i + 1) * BLOCK].clone(), v[:, :, i * BLOCK:(i + 1) * BLOCK].clone())
                size = block[0].nbytes + block[1].nbytes
                if size > self.budget_bytes:
                    return
                self.blocks[key] = block
                self.bytes += size
                while self.bytes > self.budget_bytes:
                    _, (ok, ov) = self.blocks.popitem(last=False)
                    self.bytes -= ok.nbytes + ov.nbytes

    def clear(self) -> None:
        with self._lock:
            self.blocks.clear()
            self.bytes = 0


def copy_blocks(blocks: list[tuple[torch.Tensor, torch.Tensor]], cache, row: int) -> int:
    """Write `match`'s blocks into row `row` of a KVCache from its first slot on; returns the tokens they hold."""
    for i, (k, v) in enumerate(blocks):
        cache.k[:, row, :, i * BLOCK:(i + 1) * BLOCK] = k
        cache.v[:, row, :, i * BLOCK:(i + 1) * BLOCK] = v
    return len(blocks) * BLOCK


def default_budget_mb() -> int:
    """A tenth of the memory available now (MemAvailable), at most 4 GiB; 256 MiB where it is not known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return min(4096, int(line.split()[1]) // 1024 // 10)
    except OSError:
        pass
    return 256
