"""Per-request logits rules run on the host: penalties, logit_bias, a grammar, and the logprobs read after them.

A rule changes the target's next-token distribution as a function of what the row generated so far.
Under speculation the target scores several positions in one pass, and position j of a chain follows
the row's committed output *and* the drafts before it, so each position is transformed with the
history (output + drafts[:j]) it would have had under plain decoding. The drafters transform their own
logits the same way before they draw, so their q is the distribution they really drew from; the
acceptance rules then make the output exactly the transformed target's, greedy or sampled.

Order of the transforms on a row's raw logits: repetition_penalty (prompt and output tokens), then
presence/frequency penalties (output tokens), then logit_bias, then the grammar mask; temperature, top-k
and top-p come after, in speculation/sampling.py. logprobs are the log-softmax of the logits after these
transforms and before temperature/top-k/top-p (with no rule set: the model's own distribution, as OpenAI
reports). Prompt logprobs (echo) are the model's own, untransformed.

A failure in one row's rules (an exception in its penalties, mask or logprobs, or a NaN left in its logits)
stays with that row: BatchRules records it on the RowRule (`failure`), gives the row its untransformed
logits so the batch's shared steps go on, and the Scheduler ends that request alone with the failure. A
failure is typed (`RowFailure`): a RequestError is the request's own input at fault (its grammar admits no
output from where it got, a value found bad only once it ran); anything else is a RowFault, whose message
says nothing of the cause (that goes to the log, under the fault's reference).
"""
from __future__ import annotations

import json
import logging
import math
import numbers
import traceback
import uuid
from dataclasses import dataclass, field

import torch

from ..errors import RequestError, UnsatisfiableOutputError, escape_control

# a penalty p scales logits by 1/p or p: beyond these, float32 logits overflow to inf or collapse to ties
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 10.0
MAX_LOGPROBS = 20  # OpenAI's top_logprobs bound (completions' logprobs stops at 5; serving checks that)

log = logging.getLogger("specc")


class RowFault(Exception):
    """A request's own processing raised for a reason that is not its input's (a bug, a fault). The message is
    generic, since the exception's text may show internals; the traceback is logged under `reference`."""

    def __init__(self, reference: str):
        super().__init__(f"internal error in this request's own processing (reference {reference} in the server's "
                         "log); it ended alone, the requests beside it went on")
        self.reference = reference


RowFailure = RequestError | RowFault  # why a request ended alone (finish_reason "error")


def fault_reference() -> str:
    """A fresh reference for a failure's log line: what a client is told instead of the failure's own text."""
    return uuid.uuid4().hex[:12]


def fault_log(what: str, exc: BaseException) -> tuple[str, str]:
    """A fresh reference for a failure and its log line: what failed, the reference and the traceback (control
    characters escaped but newlines, since the text may carry a request's data)."""
    reference = fault_reference()
    trace = escape_control("".join(traceback.format_exception(exc)), keep="\n")
    return reference, f"{what} (reference {reference}):\n{trace}"


def row_failure(exc: BaseException) -> RowFailure:
    """Why a request whose own processing raised `exc` fails alone: a RequestError as it is (its input is at
    fault), anything else a RowFault whose traceback goes to the log."""
    if isinstance(exc, RequestError):
        return _detached(exc)
    fault = RowFault(fault_reference())
    log.error("a request failed in its own processing (reference %s); it ends alone, the batch goes on",
              fault.reference, exc_info=exc)
    return fault


def _detached(exc: RequestError) -> RequestError:
    """`exc` without its traceback and chained exceptions: the request keeps its failure until it is answered,
    and their frames would keep the round's tensors alive that long."""
    exc.__traceback__ = exc.__context__ = exc.__cause__ = None
    return exc


def _real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class Rules:
    """What a request asks of the host beyond sampling: penalties, logit_bias, logprobs, a JSON grammar.

    logit_bias: (token id, bias) pairs, bias in [-100, 100]; logprobs: alternatives per generated token
    (0: only the chosen token's; None: no logprobs); prompt_logprobs: the prompt's too (echo);
    json_schema: a JSON schema as a JSON string, or "json_object" for any JSON object; structural_tag: an
    xgrammar structural tag as JSON text (tool calls, serving/tools.py); at most one of the two."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    prompt_logprobs: bool = False
    json_schema: str | None = None
    structural_tag: str | None = None
    grammar: object = field(default=None, compare=False, repr=False)  # json_schema or structural_tag compiled
    # (SpecModel.rules, in the request's thread: the engine thread never compiles)

    @property
    def constrained(self) -> bool:
        """Whether a grammar constrains the output (json_schema or structural_tag)."""
        return self.json_schema is not None or self.structural_tag is not None

    @property
    def transforms(self) -> bool:
        """Whether the rules change the distribution (else they only read it)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.constrained)

    @property
    def any(self) -> bool:
        return self.transforms or self.logprobs is not None or self.prompt_logprobs

    def validate(self, vocab: int) -> "Rules":
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _real(v) or not -2 <= v <= 2:
                raise RequestError(f"{name} must be a number in [-2, 2], got {v!r}")
        r = self.repetition_penalty
        if not _real(r) or not MIN_REPETITION_PENALTY <= r <= MAX_REPETITION_PENALTY:
            raise RequestError(f"repetition_penalty must be a number in [{MIN_REPETITION_PENALTY:g}, "
                               f"{MAX_REPETITION_PENALTY:g}] (1 = off), got {r!r}")
        for tok, bias in self.logit_bias:
            if not isinstance(tok, int) or isinstance(tok, bool) or not 0 <= tok < vocab:
                raise RequestError(f"logit_bias: token id {tok!r} is outside the vocabulary [0, {vocab})")
            if not _real(bias) or not -100 <= bias <= 100:
                raise RequestError(f"logit_bias: the bias of token {tok} must be a number in [-100, 100], got {bias!r}")
        n = self.logprobs
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_LOGPROBS):
            raise RequestError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {n!r}")
        if self.json_schema is not None and self.json_schema != "json_object":
            try:
                schema = json.loads(self.json_schema)
            except (TypeError, ValueError) as exc:
                raise RequestError(f"json_schema is not valid JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise RequestError(f"json_schema must be a JSON object, got {type(schema).__name__}")
        if self.json_schema is not None and self.structural_tag is not None:
            raise RequestError("json_schema and structural_tag: one grammar per request; give one of them")
        return self


class RowRule:
    """One request's rules while it generates: the settings, its prompt, and its grammar matcher (kept at
    the committed output; speculative advances are rolled back before a call returns)."""

    def __init__(self, rules: Rules, prompt: list[int], vocab: int, matcher=None):
        self.rules, self.prompt, self.vocab, self.matcher = rules, list(prompt), vocab, matcher
        self.failure: RowFailure | None = None  # why this row's own rules failed (then never applied again)
        self.bias = None
        if rules.logit_bias:
            self.bias = torch.zeros(vocab)
            for tok, b in rules.logit_bias:
                self.bias[tok] = float(b)

    def fail(self, exc: BaseException) -> None:
        """Record that this row's rules raised: the row ends with the failure (Scheduler._advance)."""
        if self.failure is None:
            self.failure = row_failure(exc)

    @property
    def active(self) -> bool:
        """The row has rules that change logits and none of them failed."""
        return self.failure is None and self.rules.transforms

    @property
    def penalises(self) -> bool:
        r = self.rules
        return bool(r.presence_penalty or r.frequency_penalty or r.repetition_penalty != 1.0 or r.logit_bias)

    def _accept(self, token: int) -> bool:
        """Advance the matcher over one token if the grammar allows it there (checked on the mask first:
        xgrammar warns on ids it cannot accept)."""
        import xgrammar as xgr

        m = self.matcher
        if m.is_terminated():
            return False
        bitmask = xgr.allocate_token_bitmask(1, self.vocab)
        m.fill_next_token_bitmask(bitmask)
        if not 0 <= token < self.vocab or not (int(bitmask[0, token // 32]) >> (token % 32)) & 1:
            return False
        return m.accept_token(token)

    def commit(self, tokens: list[int], stopped: bool = False) -> UnsatisfiableOutputError | None:
        """The row emitted these tokens, then a stop token when `stopped`: advance the grammar over them.
        Returns why the output breaks the grammar (it refused a token, or it stopped incomplete where the
        masks left nothing else), for the runtime to fail this request alone; None when it holds."""
        if self.matcher is None:
            return None
        what = "json_schema" if self.rules.structural_tag is None else "structural_tag"
        for t in tokens:
            if not self.matcher.accept_token(t):
                return UnsatisfiableOutputError(f"{what}: the grammar refused token {t} the target chose under its "
                                                "mask", field=what)
        if stopped and not self.matcher.stop_allowed():
            if self.rules.structural_tag is not None:
                return UnsatisfiableOutputError(
                    "structural_tag: the output reached a point where the tool-call grammar allows no token the model "
                    "can write, so no valid output exists from there", field=what)
            return UnsatisfiableOutputError(
                "json_schema: the output reached a point where the schema allows only raw control characters, which "
                "compact JSON forbids (a pattern that needs a tab or newline inside a string is one), so no valid "
                "output exists from there", field=what)
        return None

    def apply(self, logits: torch.Tensor, out: list[int], drafts: list[int], start: int = 0) -> torch.Tensor:
        """logits [n, V] at positions start..start+n-1 of a round; position j follows out + drafts[:j]."""
        r = self.rules
        if not r.transforms:
            return logits
        logits = logits.float().clone()
        n, vocab = logits.shape[0], logits.shape[-1]
        if r.repetition_penalty != 1.0 or r.presence_penalty or r.frequency_penalty:
            seen = torch.bincount(torch.tensor(out + drafts[:start], dtype=torch.long), minlength=vocab)[:vocab].float()
            prompt = torch.zeros(vocab, dtype=torch.bool)
            prompt[torch.tensor(self.prompt, dtype=torch.long)] = True
            for j in range(n):
                if j:
                    seen[drafts[start + j - 1]] += 1
                row = logits[j]
                if r.repetition_penalty != 1.0:
                    hit = prompt | (seen > 0)
                    row[:] = torch.where(hit, torch.where(row > 0, row / r.repetition_penalty,
                                                          row * r.repetition_penalty), row)
                row -= r.frequency_penalty * seen + r.presence_penalty * (seen > 0).float()
        if self.bias is not None:
            logits += self.bias[:vocab]
        if self.matcher is not None:
            self._mask(logits, drafts, start)
        return logits

    def _mask(self, logits: torch.Tensor, drafts: list[int], start: int) -> None:
        """Mask each position with the grammar advanced over the drafts before it; a position past a draft
        the grammar refuses keeps the last mask (acceptance stops at that draft, so it is never read)."""
        import xgrammar as xgr

        m, n = self.matcher, logits.shape[0]
        bitmask = xgr.allocate_token_bitmask(n, self.vocab)
        advanced, ok = 0, True
        for t in drafts[:start]:
            if not (ok := self._accept(t)):
                break
            advanced += 1
        for j in range(n):
            if ok and not m.is_terminated():
                m.fill_next_token_bitmask(bitmask, j)
            else:
                bitmask[j] = bitmask[j - 1] if j else -1  # unreachable: leave unmasked
            if j + 1 < n and ok:
                t = drafts[start + j]
                ok = not m.is_terminated() and 0 <= t < self.vocab and bool((int(bitmask[j, t // 32]) >> (t % 32)) & 1)
                ok = ok and m.accept_token(t)
                advanced += ok
        if advanced:
            m.rollback(advanced)
        xgr.apply_token_bitmask_inplace(logits, bitmask)

    def allowed(self, drafts: list[int]) -> int:
        """How many leading drafts the grammar allows after the committed output."""
        if self.matcher is None:
            return len(drafts)
        n = 0
        for t in drafts:
            if not self._accept(t):
                break
            n += 1
        if n:
            self.matcher.rollback(n)
        return n


@dataclass
class BatchRules:
    """The rules of a batch's rows for one round (`RowParams.rules`): each row's RowRule (or None) and
    committed output when the round started."""

    rows: list[RowRule | None]
    outs: list[list[int]]

    @property
    def transforms(self) -> bool:
        return any(r is not None and r.rules.transforms for r in self.rows)

    def apply(self, logits: torch.Tensor, drafts=None, start: int = 0) -> torch.Tensor:
        """logits [B, n, V] (or [B, V]: one position) of a round; drafts [B, W] (tensor or lists)."""
        if not self.transforms:
            return logits
        flat = logits.dim() == 2
        logits = logits[:, None] if flat else logits
        drafts = _lists(drafts, len(self.rows))
        out = self._penalise(logits.float().clone(), drafts, start)
        for b, rule in enumerate(self.rows):
            if rule is not None and rule.matcher is not None and rule.failure is None:
                try:
                    rule._mask(out[b], drafts[b], start)
                except Exception as exc:
                    rule.fail(exc)
        self._contain(out, logits)
        return out[:, 0] if flat else out

    def _contain(self, out: torch.Tensor, raw: torch.Tensor) -> None:
        """Rows whose transforms left a NaN fail (a position with no finite logit may be one that is never read:
        past a draft the grammar refuses); every failed row gets its raw logits back, so that the batch's
        shared sampling and acceptance see a valid distribution."""
        for b, rule in enumerate(self.rows):
            if rule is None:
                continue
            if rule.active and out[b].isnan().any():
                rule.fail(FloatingPointError("the request's logits rules left a NaN logit"))
            if rule.failure is not None:
                out[b] = raw[b].float()

    def _penalise(self, logits: torch.Tensor, drafts: list[list[int]], start: int) -> torch.Tensor:
        """Penalties and logit_bias of every row at once (RowRule.apply's first steps, batched): logits [B, n, V].
        Where the batched pass raises, row by row, and the rows that raise fail."""
        rows = [b for b, r in enumerate(self.rows) if r is not None and r.penalises and r.failure is None]
        if not rows:
            return logits
        try:
            return self._penalise_rows(logits, drafts, start, rows)
        except Exception:
            for b in rows:
                try:
                    logits = self._penalise_rows(logits, drafts, start, [b])
                except Exception as exc:
                    self.rows[b].fail(exc)
            return logits

    def _penalise_rows(self, logits: torch.Tensor, drafts: list[list[int]], start: int, rows: list[int]) -> torch.Tensor:
        """`_penalise` of these rows; logits change only once all of them are computed."""
        n, vocab, device = logits.shape[1], logits.shape[-1], logits.device
        idx = torch.tensor(rows, device=device)
        rules = [self.rows[b] for b in rows]
        seen = torch.zeros(len(rows), n, vocab, device=device)
        for i, b in enumerate(rows):  # counts before position 0, then each draft counted from the next position on
            before = torch.tensor(self.outs[b] + drafts[b][:start], dtype=torch.long, device=device).clamp(max=vocab - 1)
            seen[i] = torch.bincount(before, minlength=vocab)[:vocab].float()
            for j in range(1, n):
                seen[i, j:, min(drafts[b][start + j - 1], vocab - 1)] += 1
        x = logits[idx]
        rep = torch.tensor([r.rules.repetition_penalty for r in rules], device=device)[:, None, None]
        prompt = torch.zeros(len(rows), 1, vocab, dtype=torch.bool, device=device)
        for i, r in enumerate(rules):
            prompt[i, 0, torch.tensor(r.prompt, device=device).clamp(max=vocab - 1)] = True
        hit = prompt | (seen > 0)
        x = torch.where(hit, torch.where(x > 0, x / rep, x * rep), x)
        freq = torch.tensor([r.rules.frequency_penalty for r in rules], device=device)[:, None, None]
        pres = torch.tensor([r.rules.presence_penalty for r in rules], device=device)[:, None, None]
        x = x - freq * seen - pres * (seen > 0).float()
        bias = torch.stack([r.bias[:vocab] if r.bias is not None else torch.zeros(vocab) for r in rules]).to(device)
        logits[idx] = x + bias[:, None]
        return logits

    def apply_tree(self, logits: torch.Tensor, trees, nodes: list[list[int]] | None = None) -> torch.Tensor:
        """logits [B, F, V] at row b's tree nodes nodes[b] (default: every node, root first); node i follows
        the path from the root to it. Logits shared by several nodes (F == 1, a Medusa head) stay as they are."""
        if not self.transforms:
            return logits
        out = logits.float().clone()
        for b, (rule, tree) in enumerate(zip(self.rows, trees)):
            row_nodes = range(tree.size + 1) if nodes is None else nodes[b]
            if rule is None or not rule.active or (out.shape[1] == 1 and len(row_nodes) > 1):
                continue
            try:
                for f, node in enumerate(row_nodes):
                    path = [tree.tokens[a] for a in reversed(tree.ancestors(node)[:-1])]  # drafts after the root
                    out[b, f] = rule.apply(out[b, f:f + 1], self.outs[b], path, start=len(path))[0]
            except Exception as exc:
                rule.fail(exc)
        self._contain(out, logits)
        return out

    def clip(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Each row's valid draft count cut at the first draft its grammar forbids."""
        drafts, cut = tokens.tolist(), lengths.tolist()
        for b, rule in enumerate(self.rows):
            if rule is not None and rule.matcher is not None and rule.failure is None:
                try:
                    cut[b] = rule.allowed(drafts[b][: cut[b]])
                except Exception as exc:
                    rule.fail(exc)
        return torch.tensor(cut, dtype=lengths.dtype, device=lengths.device)

    def logprobs(self, logits: torch.Tensor, tokens: list[list[int]]) -> list | None:
        """Per row asking for them: [(token, logprob, [(alternative, logprob), ...]), ...] of its emitted
        tokens, read from logits [B, n, V] (already transformed) at positions 0..len(tokens[b]) - 1."""
        if not any(r is not None and r.rules.logprobs is not None for r in self.rows):
            return None
        out = []
        for b, rule in enumerate(self.rows):
            entry = None
            if rule is not None and rule.rules.logprobs is not None and rule.failure is None:
                try:
                    entry = token_logprobs(logits[b, : len(tokens[b])], tokens[b], rule.rules.logprobs)
                except Exception as exc:
                    rule.fail(exc)
            out.append(entry)
        return out


    def prompt_logprobs(self, logits: torch.Tensor, prompt_at: list[int], fed: list[int]) -> list | None:
        """Per row asking for them: the logprobs of the prompt tokens that one prefill chunk's logits [B, T, V]
        predict. Row b fed `fed[b]` tokens from prompt position prompt_at[b], and logits[b, i] predicts prompt
        token prompt_at[b] + i + 1; the first prompt token has none (logprob None). The model's own: no
        transform applies to a prompt."""
        out = []
        for b, rule in enumerate(self.rows):
            if rule is None or not rule.rules.prompt_logprobs or rule.failure is not None:
                out.append(None)
                continue
            start, prompt = prompt_at[b], rule.prompt
            n = max(0, min(fed[b], len(prompt) - 1 - start))
            head = [(prompt[0], None, [])] if start == 0 and fed[b] else []
            try:
                out.append(head + token_logprobs(logits[b, :n], prompt[start + 1:start + 1 + n], rule.rules.logprobs or 0))
            except Exception as exc:
                rule.fail(exc)
                out.append(None)
        return out


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[tuple]:
    """(token, its logprob, the top alternatives [(id, logprob)]) per position of logits [n, V]."""
    if not tokens:
        return []
    lp = torch.log_softmax(logits.float(), -1)
    chosen = lp.gather(-1, torch.tensor(tokens, dtype=torch.long)[:, None])[:, 0].tolist()
    if top:
        vals, ids = lp.topk(top, -1)
        alts = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
    else:
        alts = [[] for _ in tokens]
    return [(t, c, a) for t, c, a in zip(tokens, chosen, alts)]


def _lists(drafts, b: int) -> list[list[int]]:
    if drafts is None or (isinstance(drafts, list) and not drafts):
        return [[] for _ in range(b)]
    if isinstance(drafts, torch.Tensor):
        return drafts.tolist()
    if isinstance(drafts, list) and drafts and isinstance(drafts[0], torch.Tensor):  # per-step [B] tensors
        return torch.stack(drafts, 1).tolist()
    return [list(d) for d in drafts]
