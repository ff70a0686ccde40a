"""specc's CacheAttention kernel (csrc/attention.h): every ISA gives the scalar reference's bits, a query's output does
not depend on the pass it is in nor on the cache's spare slots, and the reference computes attention over the keys at
their positions."""
from __future__ import annotations

import numpy as np
import pytest

from specc import kernels
from specc.errors import SpeccError

pytestmark = pytest.mark.skipif(not kernels.available(), reason="specc's kernel library is not built here")


def _case(b=2, hq=6, hkv=2, t=5, s=40, d=64, cache_len=(17, 30), seed=0, head_mask=False):
    """Random inputs in the form a chain pass has them: new tokens at cache_len + j, the exported [cache ; new] mask
    (cached slots below cache_len, new tokens causal), stale values in the slots past cache_len."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, hq, t, d)).astype(np.float32)
    k_new, v_new = (rng.normal(size=(b, hkv, t, d)).astype(np.float32) for _ in range(2))
    k_cache, v_cache = (rng.normal(size=(b, hkv, s, d)).astype(np.float32) * 3 for _ in range(2))
    cl = np.array(cache_len[:b], np.int64)
    positions = cl[:, None] + np.arange(t)[None, :]
    mask = np.zeros((b, hq if head_mask else 1, t, s + t), bool)
    for i in range(b):
        mask[i, :, :, :cl[i]] = True
        mask[i, :, :, s:] = np.tril(np.ones((t, t), bool))
    if head_mask:  # a window on some heads: the mask, not the kernel, says what is attended
        mask[:, ::2, :, :5] = False
    return dict(q=q, k_new=k_new, v_new=v_new, k_cache=k_cache, v_cache=v_cache, mask=mask, cache_len=cl,
                positions=positions, scale=d ** -0.5)


def _float64_reference(c) -> np.ndarray:
    """Attention over the cache with the new keys written at their positions, in float64."""
    b, hq, t, d = c["q"].shape
    hkv, s = c["k_new"].shape[1], c["k_cache"].shape[2]
    k, v = c["k_cache"].astype(np.float64).copy(), c["v_cache"].astype(np.float64).copy()
    mask = np.zeros((b, c["mask"].shape[1], t, s), bool)
    for i in range(b):
        cl = c["cache_len"][i]
        k[i, :, cl:cl + t], v[i, :, cl:cl + t] = c["k_new"][i], c["v_new"][i]
        mask[i, :, :, :cl] = c["mask"][i, :, :, :cl]
        mask[i, :, :, cl:cl + t] = c["mask"][i, :, :, s:]
    g = hq // hkv
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    scores = np.einsum("bhtd,bhsd->bhts", c["q"].astype(np.float64), k) * c["scale"]
    scores = np.where(mask, scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    return np.einsum("bhts,bhsd->bhtd", p / p.sum(-1, keepdims=True), v)


@pytest.mark.parametrize("d", [64, 128, 48])
@pytest.mark.parametrize("head_mask", [False, True])
def test_every_isa_gives_the_scalar_references_bits(d, head_mask):
    c = _case(d=d, head_mask=head_mask)
    reference = kernels.cache_attention(**c, isa="scalar")
    for isa in kernels.supported_isas():
        for threads in (1, 2, 3):
            assert np.array_equal(kernels.cache_attention(**c, isa=isa, threads=threads), reference), (isa, threads)


def test_the_reference_is_attention_over_the_keys_at_their_positions():
    c = _case(head_mask=True)
    out, reference = kernels.cache_attention(**c, isa="scalar"), _float64_reference(c)
    assert np.abs(out - reference).max() < 2e-6 * np.abs(reference).max()  # float32 rounding, a few ulps


@pytest.mark.parametrize("isa", ["scalar", "best"])
def test_a_query_has_the_same_bits_in_a_pass_of_any_size_and_any_cache_capacity(isa):
    """Token j of a T-token pass equals the same token decoded alone after tokens 0..j-1 were committed to the cache,
    in a cache of another capacity: what a verify pass and target-only decoding must agree on."""
    isa = kernels.best_isa() if isa == "best" else isa
    full = _case(b=1, t=9, s=48, cache_len=(20,))
    whole = kernels.cache_attention(**full, isa=isa)
    for j in range(9):
        for spare in (0, 13):
            s = 20 + j + 1 + spare
            k_cache = np.zeros((1, 2, s, 64), np.float32) + np.float32(np.nan) * (spare > 0)
            v_cache = k_cache.copy()
            k_cache[:, :, :20], v_cache[:, :, :20] = full["k_cache"][:, :, :20], full["v_cache"][:, :, :20]
            k_cache[:, :, 20:20 + j], v_cache[:, :, 20:20 + j] = full["k_new"][:, :, :j], full["v_new"][:, :, :j]
            mask = np.zeros((1, 1, 1, s + 1), bool)
            mask[..., :20 + j] = True
            mask[..., s] = True
            one = dict(q=full["q"][:, :, j:j + 1], k_new=full["k_new"][:, :, j:j + 1],
                       v_new=full["v_new"][:, :, j:j + 1], k_cache=k_cache, v_cache=v_cache, mask=mask,
                       cache_len=np.array([20 + j]), positions=np.array([[20 + j]]), scale=full["scale"])
            assert np.array_equal(kernels.cache_attention(**one, isa=isa), whole[:, :, j:j + 1]), (j, spare)


def _alone(c, row: int, j: int):
    """Token j of row `row` of a chain pass as a one-token pass, with tokens 0..j-1 committed to the cache."""
    cl, s = int(c["cache_len"][row]), c["k_cache"].shape[2]
    k_cache, v_cache = c["k_cache"][row:row + 1].copy(), c["v_cache"][row:row + 1].copy()
    k_cache[:, :, cl:cl + j], v_cache[:, :, cl:cl + j] = c["k_new"][row:row + 1, :, :j], c["v_new"][row:row + 1, :, :j]
    mask = np.zeros((1, c["mask"].shape[1], 1, s + 1), bool)
    mask[..., :cl] = c["mask"][row:row + 1, :, j:j + 1, :cl]
    mask[..., cl:cl + j] = True
    mask[..., s] = True
    return dict(q=c["q"][row:row + 1, :, j:j + 1], k_new=c["k_new"][row:row + 1, :, j:j + 1],
                v_new=c["v_new"][row:row + 1, :, j:j + 1], k_cache=k_cache, v_cache=v_cache, mask=mask,
                cache_len=np.array([cl + j]), positions=np.array([[cl + j]]), scale=c["scale"])


@pytest.mark.parametrize("cache_len", [(32, 19), (0, 48)])
@pytest.mark.parametrize("head_mask", [False, True])
def test_a_prefill_chunk_gives_the_scalar_references_bits(cache_len, head_mask):
    """A prefill chunk's pass: more queries than one tile of the kernel, runs of 16 cached slots and of 16 new tokens
    (taken a block at a time), blocks across cache_len and the diagonal (slot by slot). Every ISA has the reference's
    bits, a token has the bits it has alone, and the reference is attention."""
    t = 70
    c = _case(t=t, s=max(cache_len) + t + 9, cache_len=cache_len, d=128, head_mask=head_mask)
    reference = kernels.cache_attention(**c, isa="scalar")
    assert np.abs(reference - _float64_reference(c)).max() < 2e-6 * np.abs(reference).max()
    for isa in kernels.supported_isas():
        for threads in (1, 2):
            assert np.array_equal(kernels.cache_attention(**c, isa=isa, threads=threads), reference), (isa, threads)
        for row, j in ((0, 0), (0, 17), (1, 33), (1, t - 1)):
            alone = kernels.cache_attention(**_alone(c, row, j), isa=isa)
            assert np.array_equal(alone[0, :, 0], reference[row, :, j]), (isa, row, j)


def test_a_chunk_padded_with_copies_of_its_last_token_keeps_its_bits():
    """Padding (a copy of the last token at its position) takes the kernel off its chain path onto the per-query slot
    map; the real tokens keep their bits."""
    c = _case(b=1, t=40, s=100, cache_len=(32,), d=128)
    padded = dict(c)
    for name in ("q", "k_new", "v_new"):
        padded[name] = np.concatenate([c[name]] + [c[name][:, :, -1:]] * 3, axis=2)
    padded["positions"] = np.concatenate([c["positions"]] + [c["positions"][:, -1:]] * 3, axis=1)
    mask = np.zeros((1, 1, 43, 100 + 43), bool)
    mask[..., :43 - 3, :100 + 40] = c["mask"]
    mask[..., 40:, :] = mask[..., 39:40, :]
    padded["mask"] = mask
    for isa in kernels.supported_isas():
        out = kernels.cache_attention(**padded, isa=isa)
        assert np.array_equal(out[:, :, :40], kernels.cache_attention(**c, isa=isa)), isa
        assert np.array_equal(out[:, :, 40], out[:, :, 39]), isa


PARENTS = [-1, 0, 0, 1, 1, 2, 3, 6]  # a token tree: node 0 the root, siblings share a depth


def _path(node: int) -> list[int]:
    return _path(PARENTS[node]) + [node] if node >= 0 else []


def _tree_case(isa_seed=0):
    """A tree pass: node j at cache_len + its depth, its mask row its ancestors and itself (the tree mask)."""
    t = len(PARENTS)
    c = _case(b=2, t=t, cache_len=(11, 23), seed=isa_seed)
    depth = np.array([len(_path(j)) - 1 for j in range(t)])
    c["positions"] = c["cache_len"][:, None] + depth[None, :]
    tree = np.zeros((t, t), bool)
    for j in range(t):
        tree[j, _path(j)] = True
    c["mask"][:, :, :, -t:] = tree
    return c


@pytest.mark.parametrize("isa", ["scalar", "best"])
def test_a_tree_node_has_the_bits_of_a_chain_along_its_path(isa):
    """Each node of a token tree attends over the slots a chain pass of its path would, in the same order: a
    verified tree path has target-only's bits. (A kernel that put new token s - cache_len in slot s, a chain's
    layout, fails this from node 2 on.)"""
    isa = kernels.best_isa() if isa == "best" else isa
    c = _tree_case()
    tree = kernels.cache_attention(**c, isa=isa)
    for j in range(len(PARENTS)):
        path = _path(j)
        chain = dict(c, **{name: np.ascontiguousarray(c[name][:, :, path]) for name in ("q", "k_new", "v_new")})
        chain["positions"] = c["cache_len"][:, None] + np.arange(len(path))[None, :]
        chain["mask"] = np.concatenate([c["mask"][:, :, :len(path), :-len(PARENTS)],
                                        np.broadcast_to(np.tril(np.ones((len(path),) * 2, bool)),
                                                        (2, 1, len(path), len(path)))], axis=-1)
        along = kernels.cache_attention(**chain, isa=isa)
        assert np.array_equal(tree[:, :, j], along[:, :, -1]), j
    for other in kernels.supported_isas():
        assert np.array_equal(kernels.cache_attention(**c, isa=other), kernels.cache_attention(**c, isa="scalar"))


def test_padding_copies_of_the_last_token_compute_its_values():
    c = _case(b=1, t=5, cache_len=(10,))
    c["positions"][0, 3:] = c["positions"][0, 2]  # three real tokens, two copies of the last
    for name in ("q", "k_new", "v_new"):
        c[name][:, :, 3:] = c[name][:, :, 2:3]
    c["mask"][:, :, :, -2:] = False  # nothing attends the copies' own columns
    out = kernels.cache_attention(**c)
    assert np.array_equal(out[:, :, 3], out[:, :, 2]) and np.array_equal(out[:, :, 4], out[:, :, 2])


def test_a_query_the_mask_allows_nothing_gets_zeros():
    c = _case()
    c["mask"][1, :, 2] = False
    out = kernels.cache_attention(**c)
    assert not out[1, :, 2].any() and np.isfinite(out).all()


@pytest.mark.parametrize("change", ["position", "head_size", "heads"])
def test_arguments_the_kernel_cannot_take_are_refused(change):
    c = _case()
    if change == "position":
        c["positions"][0, 0] = c["cache_len"][0] + 5
    elif change == "head_size":
        c = _case(d=40)
    else:
        c["k_new"], c["v_new"] = c["k_new"][:, :1], c["v_new"][:, :1]
        c["k_new"] = np.concatenate([c["k_new"]] * 4, axis=1)
        c["v_new"] = c["k_new"].copy()
        c["k_cache"] = np.concatenate([c["k_cache"][:, :1]] * 4, axis=1)
        c["v_cache"] = c["k_cache"].copy()
    with pytest.raises(SpeccError, match="refuses"):
        kernels.cache_attention(**c)
