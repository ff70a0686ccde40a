"""StepRunner: padding passes below `min_rows` (CPUs whose kernels give a 1-row pass other bits) and dropping the pad."""
import torch

from specc.capture.shapes import ModelDims
from specc.runtime.kv_cache import KVCache
from specc.runtime.step import StepRunner

DIMS = ModelDims(n_layers=2, n_kv_heads=1, head_dim=4, vocab_size=10)
INPUTS = ["input_ids", "position_ids", "cache_len", "logit_index", "k_cache", "v_cache", "tree_mask"]
OUTPUTS = ["logits", "new_k", "new_v", "features"]


class Recorder:
    """A graph that records what it was given and returns outputs shaped as the step ABI's."""

    def __call__(self, ids, positions, cache_len, logit_index, k, v, tree_mask):
        self.seen = {"ids": ids, "positions": positions, "tree_mask": tree_mask, "logit_index": logit_index}
        b, t = ids.shape
        tokens = ids.float()[None, :, None, :, None].expand(2, b, 1, t, 4)
        return [torch.zeros(b, logit_index.shape[1], 10), tokens, tokens + 1, ids.float()[..., None].expand(b, t, 4)]


def run(min_rows, ids, tree_mask=None):
    graph = Recorder()
    runner = StepRunner(graph, DIMS, torch.device("cpu"), INPUTS, OUTPUTS, min_rows=min_rows)
    cache = KVCache(DIMS, ids.shape[0], 64)
    cache.lengths += 5
    out = dict(zip(OUTPUTS, runner(ids, cache, logit_index=torch.zeros(ids.shape[0], 1, dtype=torch.long),
                                   tree_mask=tree_mask)))
    return graph.seen, out


def test_a_one_row_pass_runs_as_two_rows_and_returns_one():
    seen, out = run(2, torch.tensor([[7]]))
    assert seen["ids"].tolist() == [[7, 7]] and seen["positions"].tolist() == [[5, 5]]
    assert seen["tree_mask"].tolist() == [[[True, False], [True, True]]]
    assert seen["logit_index"].tolist() == [[0, 0]]  # the LM head runs on these rows: 2 of them too
    assert out["new_k"].shape == (2, 1, 1, 1, 4) and out["new_v"].shape == (2, 1, 1, 1, 4)
    assert out["features"].shape == (1, 1, 4) and out["logits"].shape == (1, 1, 10)
    assert out["new_k"].flatten().unique().tolist() == [7.0]


def test_a_given_tree_mask_grows_by_rows_nothing_sees():
    seen, _ = run(2, torch.tensor([[3]]), tree_mask=torch.ones(1, 1, 1, dtype=torch.bool))
    assert seen["tree_mask"].tolist() == [[[True, False], [False, True]]]


def test_passes_with_enough_rows_are_untouched():
    for min_rows, ids in ((2, torch.tensor([[1], [2]])), (1, torch.tensor([[4]]))):
        seen, out = run(min_rows, ids)
        assert torch.equal(seen["ids"], ids) and out["new_k"].shape[3] == ids.shape[1]
        assert seen["logit_index"].shape == (ids.shape[0], 1) and out["logits"].shape[1] == 1


def test_a_prefill_reading_one_row_of_logits_pads_only_those():
    seen, out = run(2, torch.tensor([[1, 2]]))
    assert seen["ids"].tolist() == [[1, 2]] and seen["logit_index"].tolist() == [[0, 0]]
    assert out["logits"].shape == (1, 1, 10) and out["new_k"].shape[3] == 2
