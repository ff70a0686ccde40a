"""A stand-in for `triton_python_backend_utils` (which exists only inside Triton's python-backend
stub): the part of its API that specc.triton.serving uses, with BLS requests dispatched to
models registered in MODELS. Tests install it with
`monkeypatch.setitem(sys.modules, "triton_python_backend_utils", triton_fakes)`.
"""
from __future__ import annotations

import threading

import numpy as np

TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
MODELS: dict[str, object] = {}  # BLS targets: model name -> initialized python model
LOG: list[str] = []


class Tensor:
    def __init__(self, name: str, array):
        self._name, self._array = name, np.asarray(array)

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array

    def is_cpu(self) -> bool:
        return True


class TritonError:
    INVALID_ARG, INTERNAL, CANCELLED, UNAVAILABLE = "INVALID_ARG", "INTERNAL", "CANCELLED", "UNAVAILABLE"

    def __init__(self, message: str, code: str = "INTERNAL"):
        self._message, self._code = message, code

    def message(self) -> str:
        return self._message

    def code(self) -> str:
        return self._code


class InferenceResponse:
    def __init__(self, output_tensors=(), error: TritonError | None = None):
        self._tensors, self._error = list(output_tensors), error

    def output_tensors(self) -> list[Tensor]:
        return self._tensors

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error


class Sender:
    """Records what the model sends for one request."""

    def __init__(self):
        self.responses: list[InferenceResponse] = []
        self.cancelled = False
        self.done = threading.Event()
        self.after_final = 0  # responses sent after the final flag: must stay 0

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        if self.done.is_set():
            self.after_final += 1
        if response is not None:
            self.responses.append(response)
        if flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL:
            self.done.set()

    def is_cancelled(self) -> bool:
        return self.cancelled

    # -- what the tests read ----------------------------------------------------------------
    def outputs(self, name: str) -> list[np.ndarray]:
        return [t.as_numpy() for r in self.responses for t in r.output_tensors() if t.name() == name]

    @property
    def text(self) -> str:
        return "".join(a[0].decode() for a in self.outputs("text_output"))

    @property
    def ids(self) -> list[int]:
        return [int(i) for a in self.outputs("output_ids") for i in a]

    @property
    def error(self) -> TritonError | None:
        return next((r.error() for r in self.responses if r.has_error()), None)


class Request:
    def __init__(self, inputs: dict, requested: tuple[str, ...] = ()):
        self.inputs = [Tensor(name, value) for name, value in inputs.items()]
        self.requested = list(requested)
        self.sender = Sender()

    def get_response_sender(self) -> Sender:
        return self.sender

    def requested_output_names(self) -> list[str]:
        return self.requested


class InferenceRequest:
    """A BLS request: runs the registered model's execute on it."""

    def __init__(self, model_name: str, inputs: list[Tensor], requested_output_names: list[str]):
        self.model_name, self.tensors, self.requested = model_name, inputs, requested_output_names

    def exec(self) -> InferenceResponse:
        model = MODELS.get(self.model_name)
        if model is None:
            return InferenceResponse(error=TritonError(f"model {self.model_name} is not loaded", TritonError.UNAVAILABLE))
        request = Request({t.name(): t.as_numpy() for t in self.tensors}, tuple(self.requested))
        return model.execute([request])[0]


class Logger:
    @staticmethod
    def log_error(message: str) -> None:
        LOG.append(message)


def get_input_tensor_by_name(request: Request, name: str) -> Tensor | None:
    return next((t for t in request.inputs if t.name() == name), None)


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Tensor | None:
    return next((t for t in response.output_tensors() if t.name() == name), None)
