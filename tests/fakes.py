"""Fakes for unit tests of the scheduler and rounds: a table-driven target, drafters that are right as
often as a test says, and a model object the real `Scheduler` runs on. No graphs, no compile.

The fake target is a second-order lookup table: the token after (prev, cur) is TABLE[prev, cur]. It
reads prev from its KV cache (each slot's key holds its token and position) or, inside a pass, from the
column the causal or tree mask lets it see; so a round that commits the wrong KV, or verifies a tree
node against the wrong parent, changes the output. Its logits are one-hot-ish (0 at the table's token,
-1e4 elsewhere): greedy and sampled rows alike follow the table, so the real `Verifier` and acceptance
rules run on it and every outcome is deterministic.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from specc.capture.shapes import ModelDims
from specc.methods import DraftMethod
from specc.runtime.drafters.base import DraftPlan, Drafter, Proposal
from specc.runtime.model import SpecModel
from specc.runtime.prefix_cache import PrefixCache
from specc.runtime.step import DEFAULT_CHUNK
from specc.runtime.state import Batch, Request
from specc.runtime.step import StepRunner
from specc.runtime.target import Target
from specc.runtime.verifier import Verifier
from specc.speculation.sampling import RowParams, SamplingParams
from specc.speculation.tree import DraftTree, TreeShape

VOCAB = 32
ALPHABET = "abcdefghijklmnopqrstuvwxyz012345"  # token i decodes to ALPHABET[i]
PREV0 = 0  # the "previous token" of position 0
TABLE = torch.randint(0, VOCAB, (VOCAB, VOCAB), generator=torch.Generator().manual_seed(7)).tolist()
DIMS = ModelDims(n_layers=1, n_kv_heads=1, head_dim=2, vocab_size=VOCAB)
INPUTS = ["input_ids", "position_ids", "cache_len", "logit_index", "k_cache", "v_cache"]


def continuation(tokens: list[int], n: int) -> list[int]:
    """The n tokens the table continues `tokens` with (what target-only greedy decoding emits)."""
    out = list(tokens)
    for _ in range(n):
        prev = out[-2] if len(out) > 1 else PREV0
        out.append(TABLE[prev][out[-1]])
    return out[len(tokens):]


def expected(prompt: list[int], max_new_tokens: int, eos: set[int] = frozenset()) -> tuple[list[int], str]:
    """A request's output and finish reason by the table: up to max_new_tokens, ending before an EOS."""
    out = continuation(prompt, max_new_tokens)
    for i, t in enumerate(out):
        if t in eos:
            return out[:i], "stop"
    return out, "length"


class TableRunner:
    """The fake target graph: called like a backend runner, inputs in INPUTS order (+ tree_mask). Besides logits
    and KV it returns `features` [B, T, 2]: each column's token and position (what a head drafter reads)."""

    def __init__(self, trees: bool = False):
        self.input_names = INPUTS + (["tree_mask"] if trees else [])
        self.output_names = ["logits", "new_k", "new_v", "features"]
        self.passes = 0

    def __call__(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        x = dict(zip(self.input_names, inputs))
        ids, pos, cache_len, rows, k_cache = (x[n] for n in INPUTS[:5])
        mask = x.get("tree_mask")
        b_n, t_n = ids.shape
        self.passes += 1
        for b in range(b_n):  # the committed cache holds each slot's own position
            n = int(cache_len[b])
            assert k_cache[0, b, 0, :n, 1].tolist() == list(range(n)), "KV committed at the wrong slots"
        nxt = torch.zeros(b_n, t_n, dtype=torch.long)
        for b in range(b_n):
            n = int(cache_len[b])
            for i in range(t_n):
                p = int(pos[b, i])
                if p == 0:
                    prev = PREV0
                elif p - 1 < n:
                    prev = int(k_cache[0, b, 0, p - 1, 0])
                else:  # in this pass: the visible column one position back
                    seen = [j for j in range(t_n) if int(pos[b, j]) == p - 1
                            and (bool(mask[b, i, j]) if mask is not None else j < i)]
                    assert len(seen) == 1, f"row {b} column {i}: {len(seen)} visible parents"
                    prev = int(ids[b, seen[0]])
                nxt[b, i] = TABLE[prev][int(ids[b, i])]
        picked = nxt.gather(1, rows)
        logits = torch.full((b_n, rows.shape[1], VOCAB), -1e4).scatter_(-1, picked[..., None], 0.0)
        new_k = torch.zeros(DIMS.n_layers, b_n, DIMS.n_kv_heads, t_n, DIMS.head_dim)
        new_k[0, :, 0, :, 0], new_k[0, :, 0, :, 1] = ids.float(), pos.float()
        return [logits, new_k, new_k.clone(), torch.stack([ids, pos], -1).float()]


class HeadRunner(TableRunner):
    """The fake target compiled with the verification head: the table's logits go through the real VerifyHead
    (passes/insert_verify_head.py), so acceptance runs "in the graph" and the graph returns no logits."""

    def __init__(self):
        from specc.passes.insert_verify_head import HEAD_INPUTS, VerifyHead

        super().__init__()
        self.input_names, self.head = INPUTS + list(HEAD_INPUTS), VerifyHead()
        self.output_names = ["n_accepted", "next_token", "new_k", "new_v", "features"]

    def __call__(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        logits, new_k, new_v, features = super().__call__(*inputs[:len(INPUTS)])
        n_accepted, next_token = self.head(logits, *inputs[len(INPUTS):])
        return [n_accepted, next_token, new_k, new_v, features]


class FakeTokenizer:
    """Token i is the character ALPHABET[i]."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(ALPHABET[i] for i in ids)


class FakeModel(SpecModel):
    """What `Scheduler` (and SpecModel's request and generate code) reads, over the fake target."""

    def __init__(self, drafter: Drafter | None = None, max_batch: int = 4, k: int | str = 3,
                 tree: TreeShape | None = None, eos_ids: set[int] = frozenset(), verifier: type[Verifier] = Verifier,
                 max_context: int = 256, verify_head: bool = False):
        self.runner = HeadRunner() if verify_head else TableRunner(trees=tree is not None)
        self.device, self.host_threads = torch.device("cpu"), None
        self.target = Target(StepRunner(self.runner, DIMS, self.device, self.runner.input_names,
                                        self.runner.output_names), self.runner.output_names)
        self.verifier, self.drafter = verifier(self.target), drafter
        self.max_batch, self.max_context, self.k, self.tree, self.stop_below = max_batch, max_context, k, tree, 0.0
        self.eos_ids, self.tokenizer, self.policies = set(eos_ids), FakeTokenizer(), {}
        self.defaults = SamplingParams()
        self.draft_method = drafter.method.name if drafter is not None else "none"
        self.prefill_chunk, self.interleave_chunk, self.prefix_cache = DEFAULT_CHUNK, DEFAULT_CHUNK, PrefixCache(0)

    def request(self, index: int, prompt: list[int], max_new_tokens: int = 12, temperature: float = 0.0,
                seed: int | None = None, stop: tuple[str, ...] = (), lookahead: int = 8) -> Request:
        seed = index if seed is None else seed
        return self.new_request(index, prompt, max_new_tokens, SamplingParams(temperature), seed, stop, k=lookahead)


class RowTags:
    """Draft state that names its rows, so a drafter can check it is kept row for row with the batch."""

    def __init__(self, index: list[int]):
        self.index = index

    def keep_rows(self, rows: torch.Tensor) -> None:
        self.index = [self.index[r] for r in rows.tolist()]

    def extend(self, other: "RowTags") -> None:
        self.index = self.index + other.index


FAKE = DraftMethod("fake", None, None, trees=True)

# A rule says, for a row and the round's number (0-based, per drafter), how many drafts it proposes and
# how many of them (from the first) are the table's; the rest are wrong.
Rule = Callable[[Request, int], tuple[int, int]]


class TableDrafter(Drafter):
    """Drafts from the table's own continuation, right for as many tokens as `rule` says, then wrong
    (the table's token + 1). Records what it proposed per row (`log`: index -> [(drafted, right)])."""

    method = FAKE

    def __init__(self, rule: Rule):
        self.rule, self.round, self.log = rule, 0, {}
        self.after = 0

    def prefill(self, batch: Batch, ids: torch.Tensor, lengths: torch.Tensor, verdict) -> None:
        batch.draft_state = RowTags([s.index for s in batch.seqs])

    def drafts(self, seq: Request, k: int) -> tuple[list[int], int]:
        """This round's drafts for a row (at most k) and how many of them are right."""
        n, right = self.rule(seq, self.round)
        n, right = min(n, k), min(right, n, k)
        truth = continuation(seq.tokens, n)
        return [t if i < right else (t + 1) % VOCAB for i, t in enumerate(truth)], right

    def propose(self, batch: Batch, params: RowParams, plan: DraftPlan) -> Proposal:
        assert batch.draft_state.index == [s.index for s in batch.seqs], "draft state out of step with the rows"
        rows = []
        for seq in batch.seqs:
            drafts, right = self.drafts(seq, plan.k)
            self.log.setdefault(seq.index, []).append((len(drafts), right))
            rows.append(drafts)
        self.round += 1
        width = max(len(r) for r in rows)
        tokens = torch.zeros(len(rows), width, dtype=torch.long)
        for b, (seq, r) in enumerate(zip(batch.seqs, rows)):
            # padded with the table's tokens: a rule that read past a row's drafts would accept them
            tokens[b] = torch.tensor(r + continuation(seq.tokens, width)[len(r):], dtype=torch.long)
        q = None if params.all_greedy else torch.zeros(len(rows), width, VOCAB).scatter_(-1, tokens[..., None], 1.0)
        lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
        return Proposal(tokens, q, lengths)

    def propose_tree(self, batch: Batch, shape: TreeShape, params: RowParams) -> list[DraftTree]:
        """Per row a tree of shape.depth levels: two children under each node of the table's path (the
        right one first or second, by row), the right one only while `rule` says; a wrong child also gets a
        child that continues the table's path, which only a verifier that ignores parents would accept."""
        assert batch.draft_state.index == [s.index for s in batch.seqs], "draft state out of step with the rows"
        trees = []
        for b, seq in enumerate(batch.seqs):
            n = shape.depth
            right = self.drafts(seq, n)[1]
            truth = continuation(seq.tokens, n + 1)
            tree, node = DraftTree([seq.tokens[-1]]), 0
            for level in range(n):
                good, bad = truth[level], (truth[level] + 1) % VOCAB
                first, second = (good, bad) if (b + level) % 2 else (bad, good)
                if level >= right:
                    first, second = bad, (bad + 1) % VOCAB if (bad + 1) % VOCAB != good else (bad + 2) % VOCAB
                uniform = torch.zeros(VOCAB).index_fill_(0, torch.tensor([first, second]), 0.5)
                tree.q[node] = uniform
                a, c = tree.add(node, first, -0.7, 0), tree.add(node, second, -0.7, 1)
                on_path = a if first == good else c if second == good else None
                decoy = c if on_path == a else a
                if level == 0:
                    tree.q[decoy] = torch.zeros(VOCAB).index_fill_(0, torch.tensor([truth[1]]), 1.0)
                    tree.add(decoy, truth[1], 0.0, 0)
                if on_path is None:
                    break
                node = on_path
            assert tree.size <= shape.size
            self.log.setdefault(seq.index, []).append((max(tree.depth), right))
            trees.append(tree)
        self.round += 1
        return trees

    def after_verify(self, batch: Batch, verdict) -> None:
        """Checks that the verdict's features are the committed tokens', in committed order."""
        self.after += 1
        features, cache = verdict.extra["features"], batch.cache
        for b, n in enumerate((verdict.n_accepted + 1).tolist()):
            end = int(cache.lengths[b])
            assert features[b, :n, 1].long().tolist() == list(range(end - n, end)), "features out of order"
            assert torch.equal(features[b, :n, 0], cache.k[0, b, 0, end - n:end, 0]), "features of other tokens"


def right(n: int) -> Rule:
    """k drafts (asked), the first n right."""
    return lambda seq, r: (99, n)


ALWAYS_RIGHT, ALWAYS_WRONG = right(99), right(0)


def ragged(seq: Request, r: int) -> tuple[int, int]:
    """Rows differ and change every round: some draft fewer tokens than asked (none at all now and then)."""
    return (seq.index + r) % 5, (seq.index * 3 + r) % 4


class AcceptOneMore(Verifier):
    """A broken rule: accepts one draft past the first rejection (where the row has one)."""

    def chain(self, batch, proposal, params, u_accept, u_next):
        verdict = super().chain(batch, proposal, params, u_accept, u_next)
        verdict.n_accepted = torch.minimum(verdict.n_accepted + 1, proposal.lengths)
        return verdict
