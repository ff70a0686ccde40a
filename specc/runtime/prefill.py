"""Chunked prefill: prompts enter the target cache a fixed number of tokens per pass.

Each pass runs at most `chunk` tokens per row against the cache so far, so no pass builds a
prompt-by-prompt attention mask and prefill time grows linearly with the prompt. A `Prefill` runs
one chunk per `step`, which lets the scheduler run a decode round of the running batch between a
long prompt's chunks. A row's next token is chosen in the pass that holds its last prompt token.

Rows that ask for their prompt's logprobs (echo) read every prompt row's logits, chunk by chunk: a pass
returns [rows, tokens, vocab] float32 logits, so its tokens are cut to keep that within PROMPT_LOGITS
(`echo_chunk`), and only each token's logprob and top alternatives are kept from it.
"""
from __future__ import annotations

import torch

from ..speculation.sampling import RowParams
from .kv_cache import KVCache
from .state import Batch
from .step import DEFAULT_CHUNK, TOKEN_AXIS, pad_right  # noqa: F401 (DEFAULT_CHUNK: the setting's home)
from .verifier import Verifier, Verdict

# Most logits a prefill pass reading prompt logprobs may return (2**24 float32: 64 MiB). Without a cap one
# pass over a long prompt would hold prompt x vocabulary floats (7,000 x 49,152: 1.4 GB) and its log-softmax.
PROMPT_LOGITS = 1 << 24


def echo_chunk(chunk: int, rows: int, vocab: int) -> int:
    """Tokens per row of a pass that returns every fed token's logits: at most `chunk`, and few enough
    that its [rows, tokens, vocab] logits stay within PROMPT_LOGITS."""
    return max(1, min(chunk, PROMPT_LOGITS // max(1, rows * vocab)))


class Prefill:
    """A group of prompts being prefilled into `batch.cache`, one chunk per `step`.

    Rows may start part-way (`cache.lengths`: a prefix copied from the prefix cache). A row whose
    prompt is done rides along on its last token, committing nothing, while the others finish.
    """

    def __init__(self, verifier: Verifier, batch: Batch, chunk: int, cached: list[int]):
        self.verifier, self.batch, self.chunk = verifier, batch, max(1, int(chunk))
        self.prompts = [s.prompt for s in batch.seqs]
        self.cached = cached  # tokens per row that came from the prefix cache
        self.entered = list(cached)
        self.params: RowParams = batch.params
        self.u = batch.noise(1)[:, 0]  # drawn once, as an unchunked prefill would
        self.next_token: list[int | None] = [None] * len(self.prompts)
        self.extra: dict[str, list[list[torch.Tensor]]] = {}
        # logprobs of each row's first token and, for rows that ask (echo), of its prompt, gathered chunk by chunk
        self.asks = [s.rule is not None and s.rule.rules.prompt_logprobs for s in batch.seqs]
        self.echo = any(self.asks)
        self.logprobs: list | None = [None] * len(self.prompts)
        self.prompt_logprobs: list | None = [None] * len(self.prompts)
        self._prompt_lp: list[list] = [[] for _ in self.prompts]

    @property
    def done(self) -> bool:
        return all(t is not None for t in self.next_token)

    @property
    def remaining(self) -> int:
        return max(len(p) - n for p, n in zip(self.prompts, self.entered))

    def step(self, chunk: int | None = None) -> None:
        """Enter the next chunk of every row's prompt (at most `chunk` tokens a row, default self.chunk)."""
        cache: KVCache = self.batch.cache
        size = max(1, int(chunk or self.chunk))
        if self.echo:
            size = echo_chunk(size, len(self.prompts), self.verifier.target.dims.vocab_size)
        parts = [p[n:n + size] for p, n in zip(self.prompts, self.entered)]
        counts = [len(x) for x in parts]
        ids, n_feed = pad_right([x or p[-1:] for x, p in zip(parts, self.prompts)], cache.lengths.device)
        cache.ensure(int(cache.lengths.max()) + ids.shape[1])
        rows = (n_feed - 1)[:, None]
        if self.echo:  # every prompt row's logits, the row's last one at the end
            rows = torch.minimum(torch.arange(ids.shape[1], device=ids.device)[None, :], rows)
        verdict = self.verifier.next_token(cache, ids, rows, self.params, self.u,
                                           prompt_at=list(self.entered) if self.echo else None)
        cache.commit(verdict.new_k, verdict.new_v, torch.tensor(counts, device=cache.lengths.device))
        nxt = verdict.next_token.tolist()
        for b, (p, n, c) in enumerate(zip(self.prompts, self.entered, counts)):
            if c and verdict.prompt_logprobs and verdict.prompt_logprobs[b] is not None:
                self._prompt_lp[b] += verdict.prompt_logprobs[b]
            if c and n + c == len(p):
                self.next_token[b] = nxt[b]
                self.logprobs[b] = verdict.logprobs[b] if verdict.logprobs else None
                self.prompt_logprobs[b] = self._prompt_lp[b] if self.asks[b] else None
            for name, value in verdict.extra.items():
                if name in TOKEN_AXIS:  # one entry per token (features); the rest are not about the prompt
                    self.extra.setdefault(name, [[] for _ in self.prompts])[b].append(value[b, :c])
            self.entered[b] = n + c

    def run(self) -> None:
        while not self.done:
            self.step()

    def verdict(self) -> Verdict:
        """What drafters take in at prefill: each row's next token and the target's further outputs over
        its prompt (`extra`, [B, P, ...], index j is prompt token j; zeros where the prefix cache had it)."""
        device = self.batch.cache.lengths.device
        extra = {}
        width = max(len(p) for p in self.prompts)
        for name, rows in self.extra.items():
            first = next(t for row in rows for t in row)
            out = first.new_zeros(len(rows), width, *first.shape[1:])
            for b, row in enumerate(rows):
                value = torch.cat(row)
                out[b, self.cached[b]:self.cached[b] + len(value)] = value
            extra[name] = out
        zeros = torch.zeros(len(self.prompts), dtype=torch.long, device=device)
        return Verdict(zeros, torch.tensor(self.next_token, device=device), None, None, extra)

    def prompt_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompts as [B, P] right-padded ids and their [B] lengths (what `Drafter.prefill` takes)."""
        return pad_right(self.prompts, self.batch.cache.lengths.device)
