"""The speculative orchestrator inside a decoupled python-backend model.

Triton's `execute` only parses a request's tensors and queues it; one engine thread owns the
SpecModel (its tokenizer, caches and graphs) and runs specc's continuous-batching Scheduler:
between rounds it admits queued requests into the running batch, runs one speculative round
over every request in flight (rows advance by different amounts), and sends each request
the text and token ids the round released. The last response of a request carries the
finish reason, token counts and its speculation statistics.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import SpeccError
from ..runtime.model import SpecModel
from ..runtime.engine_thread import EngineThread
from ..runtime.rules import fault_log
from ..runtime.scheduler import StreamEvent
from ..runtime.state import Request
from .interface import GenerationRequest, parse_request, response_tensors


@dataclass
class _Live:
    """A request in the scheduler."""

    sender: object
    seq: Request
    stream: bool
    requested: frozenset[str]
    text: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)


class Orchestrator(EngineThread):
    """Serves every request of one model instance with one Scheduler; `pb` is triton_python_backend_utils."""

    idle_poll_s = 0.1

    def __init__(self, model: SpecModel, pb, *, speculative: bool = True, k: int | str | None = None,
                 default_max_tokens: int = 64, log=print):
        super().__init__(model, "specc-scheduler", speculative=speculative, k=k)
        self.pb, self.log = pb, log
        self.default_max_tokens = default_max_tokens
        self.live: dict[int, _Live] = {}
        self.next_index = 0
        self.start()

    # -- Triton's execute thread ------------------------------------------------------------
    def submit(self, request) -> None:
        """Check a request's tensors; a bad one gets its error response now, a good one is queued."""
        sender = request.get_response_sender()
        try:
            parsed = parse_request(lambda name: self._input(request, name), self.default_max_tokens)
        except SpeccError as exc:
            self._fail(sender, str(exc), self.pb.TritonError.INVALID_ARG)
            return
        self.inbox.put((parsed, sender, frozenset(request.requested_output_names())))

    def close(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; requests still open get an error response."""
        super().close(timeout)
        pending = [sender for _, sender, _ in self.drain()] + [live.sender for live in self.live.values()]
        for sender in pending:
            self._fail(sender, "the model is being unloaded; the request was not finished", self.pb.TritonError.UNAVAILABLE)
        self.live.clear()

    # -- the engine thread's hooks ----------------------------------------------------------
    def admit(self, items: list) -> None:
        for parsed, sender, requested in items:
            try:
                seq = self._request(parsed)
            except SpeccError as exc:
                self._fail(sender, str(exc), self.pb.TritonError.INVALID_ARG)
                continue
            except Exception as exc:  # e.g. a chat template that fails on this prompt
                reference, line = fault_log("specc: could not prepare a request", exc)
                self.log(line)
                self._fail(sender, f"could not prepare the request (reference {reference} in the server's log)",
                           self.pb.TritonError.INTERNAL)
                continue
            self.live[seq.index] = _Live(sender, seq, parsed.stream, requested)
            self.scheduler.submit(seq)

    def after_round(self) -> None:
        for live in list(self.live.values()):
            if live.sender.is_cancelled():
                self._cut_short(live)
                self._fail(live.sender, "the request was cancelled", self.pb.TritonError.CANCELLED)

    def _request(self, r: GenerationRequest) -> Request:
        m = self.model
        params = m.sampling_params(r.temperature, r.top_k, r.top_p)
        ids = m.encode([r.prompt], chat=r.chat)[0]
        seq = m.new_request(self.next_index, ids, r.max_tokens, params, r.seed, r.stop, k=self.scheduler.lookahead)
        self.next_index += 1
        return seq

    def emit(self, ev: StreamEvent) -> None:
        live = self.live.get(ev.index)
        if live is None:  # cancelled: its final response has been sent
            return
        final = None
        if ev.finished:
            del self.live[ev.index]
            final = {"finish_reason": ev.finish_reason, "num_input_tokens": len(live.seq.prompt),
                     "num_output_tokens": len(live.seq.out), "stats": ev.stats}
        if live.stream:
            self._send(live, ev.text, ev.token_ids, final)
            return
        live.text.append(ev.text)
        live.ids += ev.token_ids
        if final is not None:
            self._send(live, "".join(live.text), live.ids, final)

    def _send(self, live: _Live, text: str, ids: list[int], final: dict | None) -> None:
        pb = self.pb
        tensors = response_tensors(text, ids, final)
        if live.requested:
            tensors = {name: value for name, value in tensors.items() if name in live.requested}
        response = pb.InferenceResponse(output_tensors=[pb.Tensor(name, value) for name, value in tensors.items()])
        flags = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final is not None else 0
        try:
            live.sender.send(response, flags=flags)
        except Exception as exc:  # the client went away: stop generating for it
            self.log(f"specc: could not send a response ({exc}); dropping the request")
            self._cut_short(live)

    def _cut_short(self, live: _Live) -> None:
        """Free the request's row at the next round and forget it."""
        self.scheduler.cancel(live.seq.index)
        self.live.pop(live.seq.index, None)

    def abort(self, exc: Exception) -> None:
        """An unexpected failure in the engine thread: answer every request in flight with the error
        and start a fresh Scheduler (the old batch's state cannot be trusted). Clients get a reference to
        the logged traceback, not the exception's text, which may show internals or another request's data."""
        reference, line = fault_log("specc: a speculative round failed", exc)
        self.log(line)
        message = (f"the speculative engine failed on the batch this request ran in (reference {reference} in the "
                   "server's log); retry the request")
        for live in self.live.values():
            self._fail(live.sender, message, self.pb.TritonError.INTERNAL)
        self.live.clear()
        self.restart()

    # -- helpers ----------------------------------------------------------------------------
    def _input(self, request, name: str):
        tensor = self.pb.get_input_tensor_by_name(request, name)
        return None if tensor is None else tensor.as_numpy()

    def _fail(self, sender, message: str, code) -> None:
        pb = self.pb
        try:
            sender.send(pb.InferenceResponse(error=pb.TritonError(message, code)),
                        flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as exc:
            self.log(f"specc: could not send an error response ({exc})")

