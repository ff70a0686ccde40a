"""KVCache: rows leave and join without changing what the remaining rows hold."""
import torch

from specc.capture.shapes import ModelDims
from specc.runtime.kv_cache import BLOCK, KVCache


def _cache(lengths: list[int]) -> KVCache:
    dims = ModelDims(n_layers=2, n_kv_heads=1, head_dim=3, vocab_size=11, dtype="float32")
    cache = KVCache(dims, len(lengths), max_context=8 * BLOCK)
    cache.ensure(max(lengths))
    cache.k = torch.randn_like(cache.k)
    cache.v = torch.randn_like(cache.v)
    cache.lengths = torch.tensor(lengths)
    return cache


def test_keep_rows_shrinks_capacity_to_the_longest_remaining_row():
    cache = _cache([5 * BLOCK - 3, 10, BLOCK + 4])
    k, v = cache.k.clone(), cache.v.clone()
    assert cache.capacity == 5 * BLOCK
    cache.keep_rows(torch.tensor([2, 1]))  # the long row leaves
    assert cache.capacity == 2 * BLOCK
    assert cache.lengths.tolist() == [BLOCK + 4, 10]
    for new, old in ((0, 2), (1, 1)):
        n = int(cache.lengths[new])
        assert torch.equal(cache.k[:, new, :, :n], k[:, old, :, :n])
        assert torch.equal(cache.v[:, new, :, :n], v[:, old, :, :n])
    cache.keep_rows(torch.tensor([1]))
    assert cache.capacity == BLOCK  # a row with `length` slots committed still has room for its pending token
    cache.ensure(3 * BLOCK)
    assert cache.capacity == 3 * BLOCK


def test_keep_rows_never_grows_capacity():
    cache = _cache([BLOCK - 1])
    cache.keep_rows(torch.tensor([0]))
    assert cache.capacity == BLOCK
