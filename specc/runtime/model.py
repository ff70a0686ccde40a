"""SpecModel: the model API users call, over the Engine the scheduler runs (runtime/engine.py).

It turns prompts into validated requests (tokenizer, chat templates, sampling settings, host-side rules)
and `generate`/`stream` run them on a Scheduler over this engine.
"""
from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence as Seq

import torch

from ..backends import Runner
from ..bundle import Bundle, open_bundle
from ..errors import RequestError, SpeccError, escape_control
from ..speculation.sampling import SamplingParams
from ..speculation.tree import TreeShape
from .engine import Engine
from .grammar import Grammars, schema_text
from .graphs import load_tokenizer
from .rules import RowFailure, RowRule, Rules
from .scheduler import Scheduler, StreamEvent
from .state import Request
from .stats import RunStats
from .text import TextStream


@dataclass
class Completion:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: dict
    logprobs: list | None = None  # per token, when asked: (token, logprob, [(alternative, logprob)])
    prompt_logprobs: list | None = None
    error: RowFailure | None = None  # finish_reason "error": why this request failed (its input or its own
    # processing, not the batch; runtime/rules.py)


class SpecModel(Engine):
    """Generate with a compiled bundle: `specc.load(path).generate(["prompt"])`."""

    def __init__(self, bundle: Bundle, open_graph: Callable[[Bundle, str], Runner] | None = None):
        super().__init__(bundle, open_graph)
        recipe = bundle.manifest.recipe
        self.defaults = SamplingParams(recipe.sampling.temperature, recipe.sampling.top_k, recipe.sampling.top_p)
        self.tokenizer = load_tokenizer(bundle)
        self.grammars = Grammars(self.tokenizer, self.target.dims.vocab_size, self.eos_ids)  # compiles on first use
        self.last_stats = RunStats()  # the most recent call's figures only; each call returns its own

    def warm(self, texts: Seq[str]) -> int:
        """Add earlier outputs (texts, e.g. from `--warm FILE`) to the suffix cache; returns the tokens added
        (0 where the model drafts without one)."""
        cache = self.suffix_cache
        if cache is None:
            return 0
        return cache.warm([self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts if t])

    # -- public API -------------------------------------------------------------------
    def generate(self, prompts: str | Seq[str] | Seq[Seq[int]], **kwargs) -> "Completions":
        """Generate for every prompt; keyword arguments as in `stream`. The result is a list of
        Completion (each with its request's stats) whose `.stats` are this call's RunStats."""
        single = isinstance(prompts, str)
        collected: dict[int, list] = {}
        stats: dict[int, dict] = {}
        logprobs: dict[int, list] = {}
        prompt_logprobs: dict[int, list] = {}
        errors: dict[int, RowFailure] = {}
        run = RunStats()
        for ev in self.stream([prompts] if single else prompts, run_stats=run, **kwargs):
            if ev.error is not None:
                errors[ev.index] = ev.error
            text, ids, reason = collected.setdefault(ev.index, ["", [], None])
            collected[ev.index] = [text + ev.text, ids + ev.token_ids, ev.finish_reason or reason]
            if ev.logprobs is not None:
                logprobs.setdefault(ev.index, []).extend(ev.logprobs)
            if ev.prompt_logprobs is not None:
                prompt_logprobs[ev.index] = ev.prompt_logprobs
            if ev.stats is not None:
                stats[ev.index] = ev.stats
        return Completions([Completion(i, *collected[i], stats=stats[i], logprobs=logprobs.get(i),
                                       prompt_logprobs=prompt_logprobs.get(i), error=errors.get(i))
                            for i in sorted(collected)], run)

    def stream(self, prompts: Seq[str] | Seq[Seq[int]], *, max_new_tokens: int = 64,
               temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
               seed: int | Seq[int] = 0, stop: Seq[str] = (), speculative: bool = True, k: int | str | None = None,
               tree: TreeShape | None = None, chat: bool = False, stop_below: float | None = None,
               run_stats: RunStats | None = None, json_schema=None, presence_penalty: float = 0.0,
               frequency_penalty: float = 0.0, repetition_penalty: float = 1.0, logit_bias: dict | None = None,
               logprobs: int | None = None, prompt_logprobs: bool = False,
               structural_tag: str | None = None) -> Iterator[StreamEvent]:
        """Yield text as rounds complete; at most max_batch rows run at once, the rest join as rows finish.

        prompts: strings (or token-id lists); chat applies the tokenizer's chat template.
        seed: one int (row i uses seed + i) or one per prompt. speculative=False runs the
        same compiled target without drafting (the in-run baseline). k asks for chain
        speculation of that length, tree for that token tree (bundles compiled for trees);
        neither: the recipe's speculation. k="auto" chooses k in [0, k_max] every round from the
        measured acceptance and costs (runtime/adaptive.py). stop_below: end a row's chain after a draft
        the drafter gave a probability below this (default: the recipe's draft.stop_below; under k auto
        any value above 0 turns on stops at the policy's own threshold). run_stats: a RunStats this call fills
        (its own figures, safe under concurrent calls); `last_stats` is whichever call started last.
        json_schema: constrain the output to this JSON schema (a dict or JSON text; "json_object": any JSON
        object); presence/frequency/repetition_penalty, logit_bias ({token id: bias}): logits transforms;
        logprobs: report each token's logprob and this many alternatives; prompt_logprobs: the prompt's too
        (runtime/rules.py says which distribution); structural_tag: constrain the output to this xgrammar
        structural tag (JSON text; tool calls, serving/tools.py). Speculation stays exact under all of them.
        """
        params = self.sampling_params(temperature, top_k, top_p)
        rules = self.rules(json_schema=json_schema, presence_penalty=presence_penalty,
                           frequency_penalty=frequency_penalty, repetition_penalty=repetition_penalty,
                           logit_bias=logit_bias, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                           structural_tag=structural_tag)
        encoded = self.encode(prompts, chat)
        seeds = _seeds(seed, len(encoded))
        scheduler = Scheduler(self, speculative=speculative, k=k, tree=tree, stop_below=stop_below)
        if run_stats is not None:
            scheduler.stats = run_stats
        for i, ids in enumerate(encoded):
            scheduler.submit(self.new_request(i, ids, max_new_tokens, params, seeds[i], stop, k=scheduler.lookahead,
                                              rules=rules))
        self.last_stats = scheduler.stats
        while scheduler.busy:
            yield from scheduler.step()

    # -- requests ---------------------------------------------------------------------
    def sampling_params(self, temperature=None, top_k=None, top_p=None) -> SamplingParams:
        """Request settings over the recipe's defaults, validated."""
        return SamplingParams(
            self.defaults.temperature if temperature is None else temperature,
            self.defaults.top_k if top_k is None else top_k,
            self.defaults.top_p if top_p is None else top_p,
        ).validate()

    def rules(self, json_schema=None, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
              repetition_penalty: float = 1.0, logit_bias: dict | None = None, logprobs: int | None = None,
              prompt_logprobs: bool = False, structural_tag: str | None = None) -> Rules | None:
        """A request's host-side rules, validated (None when it asks for none)."""
        if logit_bias is not None and not isinstance(logit_bias, dict):
            raise RequestError(f"logit_bias must be a mapping of token id to bias, got {type(logit_bias).__name__}")
        bias = _bias_pairs(logit_bias or {})
        rules = Rules(presence_penalty, frequency_penalty, repetition_penalty, tuple(sorted(bias, key=lambda x: str(x[0]))),
                      logprobs, bool(prompt_logprobs), None if json_schema is None else schema_text(json_schema),
                      structural_tag)
        rules = rules.validate(self.target.dims.vocab_size)
        # compiled here, in the request's thread (a grammar thread of its own, bounded by a time limit), so a
        # request's row never waits for it on the engine thread
        if rules.json_schema is not None:
            rules = dataclasses.replace(rules, grammar=self.grammars.compile(rules.json_schema))
        elif rules.structural_tag is not None:
            rules = dataclasses.replace(rules, grammar=self.grammars.compile_tag(rules.structural_tag))
        return rules if rules.any else None

    def new_request(self, index: int, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams,
                    seed: int, stop: Seq[str] = (), k: int = 0, rules: Rules | None = None,
                    cache_domain: bytes = b"") -> Request:
        """A validated request, ready for `Scheduler.submit`; k: tokens drafted per round (Scheduler.lookahead);
        cache_domain: the prefix cache's isolation domain (requests share cached prefixes only within one)."""
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if not _is_int(seed) or not 0 <= seed <= MAX_SEED:
            raise RequestError(f"seed must be an integer in [0, 2**64 - 1], got {seed!r}")
        stop = () if stop is None else stop
        if isinstance(stop, (str, bytes)) or not isinstance(stop, Seq) or not all(isinstance(s, str) and s for s in stop):
            raise RequestError(f"stop must be a list of non-empty strings, got {stop!r}")
        for s in stop:
            _check_text(s, "a stop string")
        need = len(prompt_ids) + max_new_tokens + k + 1
        if need > self.max_context:
            raise RequestError(
                f"prompt of {len(prompt_ids)} tokens + max_new_tokens {max_new_tokens} + speculation {k + 1} = {need} tokens, "
                f"above this bundle's max_context {self.max_context}; shorten the prompt or max_new_tokens, "
                "or compile with a larger limits.max_context"
            )
        rule = None
        if rules is not None and rules.any:
            if self.target.verify_head:
                raise RequestError("this bundle accepts drafts inside its target graph (speculation.verify_head), so "
                                   "its logits never reach the host: logprobs, penalties, logit_bias and structured "
                                   "output need a bundle compiled without the verification head")
            matcher = (self.grammars.matcher(rules.json_schema, rules.grammar) if rules.json_schema is not None else
                       self.grammars.tag_matcher(rules.structural_tag, rules.grammar)
                       if rules.structural_tag is not None else None)
            rule = RowRule(rules, prompt_ids, self.target.dims.vocab_size, matcher)
        return Request(index, list(prompt_ids), max_new_tokens, params, torch.Generator().manual_seed(seed),
                       TextStream(self.tokenizer, tuple(stop)), rule=rule, cache_domain=bytes(cache_domain))

    def encode(self, prompts, chat: bool = False) -> list[list[int]]:
        """Token ids of each prompt (strings, or token-id lists checked against the vocabulary)."""
        if isinstance(prompts, str) or not isinstance(prompts, Seq) or len(prompts) == 0:
            raise RequestError("prompts must be a non-empty list of strings (or of token-id lists)")
        vocab = self.target.dims.vocab_size
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                if not p:
                    raise RequestError(f"prompt {i} is empty; give at least one character")
                _check_text(p, f"prompt {i}")
                if chat:
                    ids = self._chat_ids([{"role": "user", "content": p}], f"prompt {i}")
                else:
                    ids = self.tokenizer(p, add_special_tokens=True)["input_ids"]
            elif isinstance(p, Seq) and not isinstance(p, (bytes, bytearray)) and p and all(_is_int(t) for t in p):
                ids = [int(t) for t in p]
                bad = [t for t in ids if not 0 <= t < vocab]
                if bad:
                    raise RequestError(f"prompt {i} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
            else:
                raise RequestError(f"prompt {i} must be a non-empty string or list of token ids, got {type(p).__name__}")
            if not ids:
                raise RequestError(f"prompt {i} encodes to no tokens")
            out.append(list(ids))
        return out

    def _chat_ids(self, messages: list[dict], where: str) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestError(NO_CHAT_TEMPLATE)
        from jinja2 import TemplateError

        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                      return_dict=False)
        except TemplateError as exc:  # the template's raise_exception, or an undefined value it needs
            raise RequestError(f"{where}: the chat template refused it: {exc}") from None

    def set_chat_template(self, template: str, where: str = "chat template") -> None:
        """Format chat prompts with this Jinja template (the `chat_template` of a tokenizer_config.json) instead
        of the tokenizer's own, e.g. for a GGUF model converted without one; checked by rendering a message."""
        if not isinstance(template, str) or not template.strip():
            raise SpeccError(f"{where}: empty; allowed a Jinja chat template (as in a tokenizer_config.json)")
        try:
            self.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=template,
                                               add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # jinja2's syntax and runtime errors, transformers' own checks
            raise SpeccError(f"{where}: not a chat template this tokenizer can render: {type(exc).__name__}: "
                             f"{str(exc)[:300]}") from None
        self.tokenizer.chat_template = template


NO_CHAT_TEMPLATE = ("this bundle's tokenizer has no chat template, so chat prompts cannot be formatted; give one with "
                    "--chat-template FILE (a Jinja template, as in a tokenizer_config.json; in Python "
                    "model.set_chat_template(text)), or send plain prompts")
MAX_CHAT_TEMPLATE_BYTES = 1 << 20


def read_chat_template(path: str | Path) -> str:
    """The text of a --chat-template FILE, or one SpeccError naming the file."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if not path.is_file():
            raise SpeccError(f"--chat-template {path}: not a file; allowed a Jinja template file")
        if size > MAX_CHAT_TEMPLATE_BYTES:
            raise SpeccError(f"--chat-template {path}: {size} bytes; allowed at most {MAX_CHAT_TEMPLATE_BYTES}")
        return path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise SpeccError(f"--chat-template {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise SpeccError(f"--chat-template {path}: not UTF-8 text; allowed a Jinja template file") from None


def warm_from(model: SpecModel, texts: list[str], log=print) -> None:
    """Seed a model's suffix cache with texts (--warm FILE) (a note where the bundle drafts without one)."""
    if not texts:
        return
    if model.suffix_cache is None:
        log(f"--warm: bundle {model.bundle.path} drafts with {model.draft_label}, not suffix decoding; file not used")
        return
    log(f"--warm: {model.warm(texts)} tokens of {len(texts)} earlier outputs in the suffix cache")


class Completions(list):
    """The completions of one `generate` call, in prompt order; `stats` are that call's RunStats."""

    def __init__(self, items: list[Completion], stats: RunStats):
        super().__init__(items)
        self.stats = stats


MAX_SEED = 2**64 - 1  # a torch generator's seed range (and the Triton interface's UINT64 seed)


def _bias_pairs(logit_bias: dict) -> list[tuple[int, object]]:
    """(token id, bias) of a logit_bias mapping whose keys are ids or their decimal strings ("7"); two keys
    naming one id ("7" and "07") are refused rather than one silently winning."""
    pairs: dict[int, str] = {}
    out = []
    for key, b in logit_bias.items():
        tok = key
        if isinstance(key, str):
            if not (key.isascii() and key.isdigit() and len(key) <= 12):
                raise RequestError(f"logit_bias: key {escape_control(key[:40])!r} is not a token id; allowed decimal "
                                   "digits naming an id of the vocabulary, e.g. \"1234\"")
            tok = int(key)
        if _is_int(tok) and tok in pairs:
            raise RequestError(f"logit_bias: keys {pairs[tok]!r} and {key!r} both name token {tok}; give each id once")
        if _is_int(tok):
            pairs[tok] = key
        out.append((tok, b))
    return out


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _check_text(text: str, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(f"{what} is not valid Unicode text: {exc.reason} at character {exc.start} "
                           f"({text[exc.start:exc.end]!r}); send UTF-8 text") from None


def _seeds(seed, n: int) -> list[int]:
    if _is_int(seed):
        seeds = [int(seed) + i for i in range(n)]
    else:
        seeds = list(seed) if isinstance(seed, Seq) and not isinstance(seed, (str, bytes)) else []
        if len(seeds) != n or not all(_is_int(s) for s in seeds):
            raise RequestError(f"seed must be one int or one int per prompt ({n}), got {seed!r}")
    if not all(0 <= s <= MAX_SEED for s in seeds):
        raise RequestError(f"seed must be in [0, 2**64 - 1] (row i uses seed + i), got {seed!r}")
    return [int(s) for s in seeds]


def load(path: str | Path, verify: bool = True, expect_id: str | None = None, trust_code: bool = False) -> SpecModel:
    """Open a bundle and load its engines.

    verify: check every file's sha256 (sizes and the file listing are always checked).
    expect_id: refuse a bundle whose id (`specc inspect`) differs: what production pins.
    trust_code: allow backends that execute code from the bundle (aoti, torch_tensorrt)."""
    return SpecModel(open_bundle(path, verify=verify, expect_id=expect_id, trust_code=trust_code))
