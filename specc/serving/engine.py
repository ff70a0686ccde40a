"""The engine loop of `specc serve`: one Scheduler, stepped by one worker thread, fanned out to asyncio.

Request handlers (the event loop) tokenise a request's prompts in a thread pool (`prepare`: never
on the event loop, never on the engine thread, so a huge prompt delays nobody else), then call
`submit`, which queues a Job and returns at once; the worker thread hands the sequences to the
Scheduler between rounds, runs rounds while there is work, and posts every StreamEvent to the
job's asyncio.Queue with `call_soon_threadsafe`. A job's first message is `Admitted` (or an
APIError: a prompt too long for the context), then its events. `cancel` (a client that went
away) frees the rows at the next round. Nothing a request does can stop the thread: a request whose
own processing fails (its rules, stop strings, text) ends alone, with a 400 when its input is at fault
and a 500 otherwise (serving/row_failures.py); a round that fails as a whole answers the requests in its
batch with an error and the engine goes on with a fresh Scheduler, which takes over the requests still
waiting for a row.
"""
from __future__ import annotations

import asyncio
import itertools
import threading
import time
import traceback
from dataclasses import dataclass, field

try:
    from jinja2 import TemplateError
except ImportError:  # transformers renders chat templates with jinja2; without it there is nothing to catch
    TemplateError = ()

from ..errors import RequestError
from ..runtime.model import SpecModel
from ..runtime.engine_thread import EngineThread
from ..runtime.rules import Rules, fault_log
from ..runtime.scheduler import StreamEvent
from ..speculation.sampling import SamplingParams
from .memory import trim
from .metrics import Metrics
from .schemas import APIError

TRIM_PROMPT_TOKENS = 1024  # a request with a prompt this long (or with echo) gives memory back when it ends


@dataclass
class Job:
    """One API request: its prompts (text, token ids, or a chat conversation), n samples of each."""

    prompts: list  # str | list[int] | list[dict] (chat messages) per prompt
    chat: bool
    max_tokens: int | None  # None: up to the context limit
    params: SamplingParams
    seed: int
    stop: list[str]
    n: int = 1
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    indices: list[int] = field(default_factory=list)  # Scheduler index of each choice
    cancelled: bool = False
    rules: Rules | None = None  # penalties, logit_bias, logprobs, response_format (runtime/rules.py)
    echo: bool = False  # completions: the prompt leads the text (and its logprobs, when asked)
    events_streamed: bool = False  # the reply streams each event (else the handler assembles the whole)
    prepared: bool = False  # prompts are token ids already (`AsyncEngine.prepare`)
    tools: list[dict] | None = None  # chat: the tools the chat template renders (serving/tools.py)
    cache_domain: bytes = b""  # the prefix cache's isolation domain (the API key, cache_salt)
    polled: float = field(default_factory=time.monotonic)  # when the handler last looked for a disconnect


@dataclass
class Admitted:
    prompt_tokens: list[int]  # per choice


@dataclass
class Failed:
    message: str


@dataclass
class ShuttingDown(Failed):
    """The server stopped the job: it is shutting down and the grace period is over."""


class AsyncEngine(EngineThread):
    def __init__(self, model: SpecModel, *, k: int | str | None = "auto", speculative: bool = True,
                 max_batch: int | None = None, max_queue: int = 256, metrics: Metrics | None = None, log=print):
        super().__init__(model, "specc-engine", speculative=speculative, k=k, max_batch=max_batch)
        self.log, self.max_queue = log, max_queue
        self.metrics = metrics or Metrics(max(self.scheduler.k, 1), self.scheduler.max_batch)
        if metrics is None and speculative and model.suffix_cache is not None:
            self.metrics.watch_suffix(model.suffix_cache)
        self.live: dict[int, Job] = {}
        self._trim_due = False  # a large request ended: give its buffers' memory back to the system
        self._busy = False  # rounds ran since the engine was last idle
        self._queued = 0  # sequences submitted by handlers and not yet in a batch row
        self._lock = threading.Lock()
        self._next_index = itertools.count()
        # prompt text longer than this cannot fit the context whatever it says: no token covers more than
        # max_token_bytes of text, and a character is at least one byte; such text is refused untokenised
        self.max_prompt_chars = model.max_context * max_token_bytes(model.tokenizer)

    # -- the event loop's side -----------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        """Sequences waiting for a batch row (submitted, not yet prefilled)."""
        return self._queued

    def check_room(self, need: int) -> None:
        """APIError 400 for a request of `need` sequences that no queue state could take (the queue is
        smaller), 429 when it could later but the queue is full now."""
        if need > self.max_queue:
            raise APIError(400, f"this request asks for {need} sequences (prompts x n); this server queues at "
                                f"most {self.max_queue} (--max-queue): send fewer prompts or a smaller n per "
                                "request", "n" if need == 1 else None, code="request_too_large")
        if self._queued + need > self.max_queue:
            raise APIError(429, f"the server's queue is full ({self._queued} of {self.max_queue} sequences "
                                "waiting); retry later", type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"})

    def submit(self, job: Job) -> Job:
        """Queue a job (event loop thread); APIError 400 when it is larger than the queue, 429 when the
        queue is full."""
        need = len(job.prompts) * job.n
        with self._lock:
            self.check_room(need)
            self._queued += need
            job.loop = asyncio.get_running_loop()
            job.indices = [next(self._next_index) for _ in range(need)]
            self.inbox.put(job)
        return job

    def cancel(self, job: Job) -> None:
        """Stop a job (any thread): queued sequences are dropped, running rows freed at the next round."""
        job.cancelled = True
        for index in job.indices:
            self.scheduler.cancel(index)

    # -- the worker thread's hooks ----------------------------------------------------------------
    def admit(self, jobs: list[Job]) -> None:
        for job in jobs:
            self._admit(job)

    def idle(self) -> None:
        self.metrics.idle(self.queue_depth)
        if self._busy or self._trim_due:
            self._busy = self._trim_due = False
            trim()

    def after_round(self) -> None:
        self._busy = True
        if self._trim_due:  # between rounds: the C call releases the interpreter lock, and takes a few ms
            self._trim_due = False
            trim()
        self._count_admitted()
        self.metrics.observe_prefix_cache(self.model.prefix_cache)
        if self.scheduler.last_round is not None:
            self.metrics.observe_round(self.scheduler.last_round, self.queue_depth)
            self.scheduler.last_round = None

    def _admit(self, job: Job) -> None:
        if job.cancelled:
            self._dequeued(len(job.indices))
            return
        try:
            seqs = self._sequences(job)
        except APIError as exc:
            self._dequeued(len(job.indices))
            self._post(job, exc)
            return
        except RequestError as exc:  # the runtime's own checks of a request (e.g. seed + row past 2**64 - 1)
            self._dequeued(len(job.indices))
            self._post(job, APIError(400, str(exc)))
            return
        except Exception as exc:  # e.g. a chat template that fails on these messages
            self.log(f"specc serve: could not prepare a request:\n{traceback.format_exc()}")
            self._dequeued(len(job.indices))
            self._post(job, APIError(400, f"could not prepare the request: {type(exc).__name__}: {exc}"))
            return
        self._post(job, Admitted([len(s.prompt) for s in seqs]))
        for seq in seqs:
            self.live[seq.index] = job
            self.scheduler.submit(seq)

    def _sequences(self, job: Job) -> list:
        m, lookahead = self.model, self.scheduler.lookahead
        seqs = []
        for p, prompt in enumerate(job.prompts):
            ids = prompt if _is_ids(prompt) and job.prepared else self.encode_prompt(prompt, job.chat, p, job.tools)
            room = m.max_context - len(ids) - lookahead - 1
            if room < 1:
                raise APIError(400, f"the prompt is {len(ids)} tokens; this model's context is {m.max_context} "
                                    f"tokens (with {lookahead + 1} kept for speculation)",
                               "messages" if job.chat else "prompt", code="context_length_exceeded")
            max_tokens = room if job.max_tokens is None else job.max_tokens
            if max_tokens > room:
                raise APIError(400, f"max_tokens {max_tokens} + the prompt's {len(ids)} tokens exceed this model's "
                                    f"context of {m.max_context} tokens (with {lookahead + 1} kept for speculation): "
                                    f"at most {room} here", "max_tokens", code="context_length_exceeded")
            for j in range(job.n):
                index = job.indices[p * job.n + j]
                seqs.append(m.new_request(index, ids, max_tokens, job.params, job.seed + p * job.n + j, job.stop,
                                           k=lookahead, rules=job.rules, cache_domain=job.cache_domain))
        return seqs

    # -- prompts (a thread pool's side: `prepare`) ---------------------------------------------
    def prepare(self, job: Job) -> Job:
        """Tokenise the job's prompts (a worker thread of the app's pool): APIError 400 for one that is not
        valid or cannot fit the context."""
        job.prompts = [self.encode_prompt(prompt, job.chat, p, job.tools) for p, prompt in enumerate(job.prompts)]
        job.prepared = True
        return job

    def check_length(self, prompt, chat: bool, p: int) -> None:
        """Refuse, without tokenising, a prompt too long for the context whatever its tokens (cheap: the
        event loop calls it)."""
        where = _where(chat, p)
        if isinstance(prompt, str):
            if len(prompt) > self.max_prompt_chars:
                raise APIError(400, f"{where}: the prompt is {len(prompt)} characters; this model's context of "
                                    f"{self.model.max_context} tokens cannot hold more than {self.max_prompt_chars} "
                                    "characters of text", where, code="context_length_exceeded")
        elif isinstance(prompt, list) and len(prompt) > self.model.max_context:
            raise APIError(400, f"{where}: the prompt is {len(prompt)} tokens; this model's context is "
                                f"{self.model.max_context} tokens", where, code="context_length_exceeded")

    def encode_prompt(self, prompt, chat: bool, p: int = 0, tools: list[dict] | None = None) -> list[int]:
        """Token ids of one prompt (text, token ids, or chat messages rendered with the chat template, with
        the tools when given)."""
        where = _where(chat, p)
        if chat:
            tok = self.model.tokenizer
            if not getattr(tok, "chat_template", None):
                raise APIError(400, "this model's tokenizer has no chat template, so messages cannot be formatted; "
                                    "use /v1/completions, or serve it with specc serve --chat-template FILE",
                               "messages", code="no_chat_template")
            try:
                text = tok.apply_chat_template(prompt, tools=tools, add_generation_prompt=True, tokenize=False)
            except TemplateError as exc:  # the template refuses these messages (raise_exception, an undefined value)
                raise APIError(400, f"messages: the chat template refused them: {exc}", "messages") from None
            self.check_length(text, True, p)
            return list(tok(text, add_special_tokens=False)["input_ids"])
        self.check_length(prompt, False, p)
        try:
            return self.model.encode([prompt])[0]
        except RequestError as exc:
            raise APIError(400, f"{where}: {str(exc).replace('prompt 0', 'the prompt')}", where) from None

    def _count_admitted(self) -> None:
        """Sequences the Scheduler has taken from its queue into the batch leave the queue count."""
        waiting = len(self.scheduler.waiting)
        with self._lock:
            self._queued = waiting + self.inbox.qsize()

    def _dequeued(self, n: int) -> None:
        with self._lock:
            self._queued -= n

    def emit(self, ev: StreamEvent) -> None:
        job = self.live.get(ev.index)
        if job is None:
            return
        if ev.finished:
            del self.live[ev.index]
            if job.echo or any(len(p) >= TRIM_PROMPT_TOKENS for p in job.prompts if isinstance(p, list)):
                self._trim_due = True
        self._post(job, ev)

    def _post(self, job: Job, item) -> None:
        try:
            job.loop.call_soon_threadsafe(job.events.put_nowait, item)
        except RuntimeError:  # the event loop is closed (server shutting down)
            pass

    def abort(self, exc: Exception) -> None:
        """A round failed: every request in the batch (or being prefilled) gets the error; a fresh Scheduler
        goes on, with the requests still waiting for a row, which never ran. Clients get a reference to the logged
        traceback, not the exception's text, which may show internals (or another request's data)."""
        reference, line = fault_log("specc serve: a round failed", exc)
        self.log(line)
        message = (f"the engine failed on the batch this request ran in (reference {reference} in the server's "
                   "log); the server goes on, retry the request")
        waiting = list(self.scheduler.waiting)
        spared = {s.index for s in waiting}
        failed = {id(j): j for i, j in self.live.items() if i not in spared}
        for job in failed.values():
            self._post(job, Failed(message))
        self.live = {i: j for i, j in self.live.items() if id(j) not in failed}
        self.restart()
        for seq in waiting:
            if seq.index in self.live:  # not a sequence of a job that failed
                self.scheduler.submit(seq)
        with self._lock:
            self._queued = self.inbox.qsize() + len(self.scheduler.waiting)



def _where(chat: bool, p: int) -> str:
    return "messages" if chat else ("prompt" if p == 0 else f"prompt.{p}")


def _is_ids(prompt) -> bool:
    return isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)


def max_token_bytes(tokenizer) -> int:
    """An upper bound on the bytes of text one token stands for: the longest entry of the vocabulary
    (added tokens included) in UTF-8, which over-counts byte-level and SentencePiece markers (safe: it
    only loosens the bound); 4x that where the tokenizer normalises text first (NFC can compose up to
    three characters' bytes into one)."""
    try:
        vocab = tokenizer.get_vocab()
        longest = max((len(t.encode("utf-8", "replace")) for t in vocab), default=1)
    except Exception:  # a tokenizer without a readable vocabulary: no bound from it
        return 1 << 40
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    normalizer = getattr(backend, "normalizer", None)
    return max(longest, 1) * (4 if normalizer is not None else 1)
