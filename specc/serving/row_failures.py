"""The answer to a request that failed alone while it ran (runtime/rules.py RowFailure), chosen by the failure's
type, never by its message's wording: the request's own input at fault is a 400 naming the field; anything else
is a 500 with a generic message (the cause is in the server's log). Either way the batch beside it goes on."""
from __future__ import annotations

import logging

from ..errors import RequestError, UnsatisfiableOutputError
from ..runtime.rules import RowFault
from .schemas import APIError

# the runtime's names of request settings, as the API calls them
API_PARAMS = {"json_schema": "response_format", "structural_tag": "tools"}
GENERIC = "internal error in this request's own processing; it ended alone, the requests beside it went on"

log = logging.getLogger("specc")


def request_failed(failure: BaseException) -> APIError:
    """The APIError answering a request that ended alone with `failure`."""
    if isinstance(failure, RequestError):
        return _input_at_fault(failure)
    return _internal(failure)


def api_param(error: RequestError, chat: bool = False) -> str:
    """The request field at fault, as the API calls it: the error's `field`, else its message's first word (every
    check names its field first)."""
    field = error.field or str(error).split(" ")[0].rstrip(":")
    if field == "logprobs" and chat:
        return "top_logprobs"
    return API_PARAMS.get(field, field)


def _input_at_fault(failure: RequestError) -> APIError:
    """400: the message names what is wrong; param the field, where the failure knows it."""
    code = "unsatisfiable_schema" if isinstance(failure, UnsatisfiableOutputError) else None
    return APIError(400, str(failure), API_PARAMS.get(failure.field, failure.field), code=code)


def _internal(failure: BaseException) -> APIError:
    """500: a RowFault's message points to its log line; any other exception here (a type no runtime path
    should produce) is logged now, and its text stays out of the answer."""
    if isinstance(failure, RowFault):
        message = str(failure)
    else:
        log.error("a request failed alone with an unexpected %s", type(failure).__name__, exc_info=failure)
        message = GENERIC
    return APIError(500, message, type="server_error", code="request_failed")
