"""The reply to one completions or chat completions request, assembled (or streamed) choice by choice as the
engine's events arrive, with the latency metrics they imply."""
from __future__ import annotations

import time

from ..runtime.scheduler import StreamEvent
from .engine import Job
from .schemas import choice, completion_object, logprobs_object, new_id, usage
from .tools import ToolReply


class Reply:
    """The choices of one request as its events arrive; latency metrics on the way."""

    def __init__(self, job: Job, model: str, chat: bool, start: float, prompt_tokens: int, metrics, tokenizer=None,
                 token_bytes: list[bytes] | None = None, tools: ToolReply | None = None):
        self.job, self.model, self.chat, self.start, self.metrics = job, model, chat, start, metrics
        self.tokenizer, self.token_bytes = tokenizer, token_bytes
        self.tools = tools  # the choices are read for tool calls
        self.logprobs: list[list] = [[] for _ in job.indices]  # (token, logprob, alternatives) per choice
        self.offsets = [0] * len(job.indices)  # text offset of the next token, per choice (completions' logprobs)
        self.echoed = [False] * len(job.indices)
        self.pieces: list[dict | None] = [None] * len(job.indices)  # the whole reply's logprobs per choice
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.prompt_tokens = prompt_tokens
        self.position = {index: i for i, index in enumerate(job.indices)}
        self.texts = [""] * len(job.indices)
        self.reasons: list[str | None] = [None] * len(job.indices)
        self.completion_tokens = 0
        self.cached = [0] * len(job.indices)  # prompt tokens the prefix cache supplied, per choice
        self.last_token_at: float | None = None
        self.open = len(job.indices)
        metrics.prompt_tokens.inc(prompt_tokens)

    @property
    def done(self) -> bool:
        return self.open == 0

    def add(self, ev: StreamEvent) -> tuple[int, StreamEvent]:
        now = time.perf_counter()
        i = self.position[ev.index]
        if ev.cached_tokens is not None:
            self.cached[i] = ev.cached_tokens
        if not self.job.events_streamed:
            text, logprobs = self.piece(i, ev)
            self.texts[i] += text
            if logprobs is not None:
                self.pieces[i] = _merge(self.pieces[i], logprobs)
        else:
            self.texts[i] += ev.text
        n = len(ev.token_ids)
        if n:
            if self.last_token_at is None:
                self.metrics.ttft.observe(now - self.start)
            else:
                for _ in range(n):
                    self.metrics.itl.observe((now - self.last_token_at) / n)
            self.last_token_at = now
            self.completion_tokens += n
            self.metrics.observe_tokens(n)
        if ev.finished:
            self.reasons[i] = ev.finish_reason
            self.open -= 1
            if self.done:
                self.metrics.request_latency.observe(now - self.start)
                for reason in self.reasons:
                    self.metrics.success.labels(finished_reason=reason).inc()
        return i, ev

    def echo_text(self, i: int) -> str:
        """The prompt as text, decoded as generated text is (special tokens write nothing), so that logprobs'
        text_offset, which moves by the text each token adds, indexes it."""
        prompt = self.job.prompts[i // self.job.n]
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt, skip_special_tokens=True)

    def piece(self, i: int, ev: StreamEvent) -> tuple[str, dict | None]:
        """A streamed event's text (the prompt first, under echo) and its logprobs object."""
        text, entries = ev.text, list(ev.logprobs or [])
        if self.job.echo and not self.echoed[i]:
            self.echoed[i] = True
            text = self.echo_text(i) + text
            if ev.prompt_logprobs is not None:
                entries = list(ev.prompt_logprobs) + entries
        wanted = ev.logprobs is not None or ev.prompt_logprobs is not None
        if not wanted:
            return text, None
        obj, self.offsets[i] = logprobs_object(entries, self.tokenizer, self.chat, self.offsets[i], self.token_bytes)
        return text, obj

    def usage(self) -> dict:
        """Tokens as OpenAI counts them: each prompt once (not once per n), its cached part as its first choice's."""
        return usage(self.prompt_tokens, self.completion_tokens, sum(self.cached[::self.job.n]))

    def chunk(self, choices: list[dict], use: dict | None = None) -> dict:
        return completion_object(self.id, self.model, choices, use, chunk=True, chat=self.chat)

    def whole(self) -> dict:
        choices = [choice(i, t, r, self.chat, False, logprobs=lp)
                   for i, (t, r, lp) in enumerate(zip(self.texts, self.reasons, self.pieces))]
        if self.tools is not None:
            choices = [self.tools.whole(c, t) for c, t in zip(choices, self.texts)]
        return completion_object(self.id, self.model, choices, self.usage(),
                                 chunk=False, chat=self.chat)


def _merge(whole: dict | None, part: dict) -> dict:
    """Append one event's logprobs object to a choice's."""
    if whole is None:
        return part
    for key, value in part.items():
        whole[key] = whole[key] + value
    return whole
