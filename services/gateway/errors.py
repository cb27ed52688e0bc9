"""Errors for HTTP clients, in OpenAI's shape: ``{"error": {message, type, param, code}}``.

Every failure the gateway answers with (bad input, unknown model, a tokenizer's
refusal, a missing service, a timeout) is raised as ``ApiError`` and turned into
one JSON response by the routes; the status and body of a tokenizer's
``ErrorInfo`` pass through unchanged.
"""

from __future__ import annotations

import msgspec
from starlette.responses import Response

from shared.protocol import ErrorInfo

_json = msgspec.json.Encoder()
# What a 429 (an engine's waiting queue is full) tells the client to wait.
RETRY_AFTER_SECONDS = "1"


class ApiError(Exception):
    """A request ends with this HTTP status and OpenAI-shaped error body.

    ``maybe_submitted``: raised by a tokenize request that may still have reached an
    engine (no answer in time), so the request id must be aborted there.
    """

    maybe_submitted = False

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.info = ErrorInfo(message, type=type, param=param, code=code, status=status)

    @classmethod
    def from_info(cls, info: ErrorInfo) -> "ApiError":
        return cls(info.message, status=info.status, type=info.type, param=info.param, code=info.code)

    @property
    def status(self) -> int:
        return self.info.status


def error_body(info: ErrorInfo) -> dict:
    return {"error": {"message": info.message, "type": info.type, "param": info.param, "code": info.code}}


def json_response(body, status: int = 200) -> Response:
    return Response(_json.encode(body), status_code=status, media_type="application/json")


def error_response(info: ErrorInfo) -> Response:
    response = json_response(error_body(info), info.status)
    if info.status == 429:
        response.headers["Retry-After"] = RETRY_AFTER_SECONDS
    return response


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """A 400 for a request the gateway rejects at the edge, naming the parameter."""
    return ApiError(message, status=400, param=param, code=code)


# Errors the gateway raises itself when the bus cannot serve a request.
def no_tokenizer() -> ApiError:
    return ApiError("no tokenizer service is available", status=503, type="service_unavailable")


def tokenizer_timeout(seconds: float) -> ApiError:
    error = ApiError(f"the tokenizer service did not answer within {seconds:g}s", status=504,
                     type="service_unavailable")
    error.maybe_submitted = True
    return error


def bus_unavailable(reason: str) -> ApiError:
    error = ApiError(f"the message bus is unavailable: {reason}", status=503, type="service_unavailable")
    error.maybe_submitted = True
    return error


def request_timeout(seconds: float) -> ApiError:
    return ApiError(f"the request did not finish within {seconds:g}s", status=504, type="timeout")


def engine_lost(engine_id: str, why: str) -> ApiError:
    return ApiError(f"engine {engine_id} {why}; the request was lost, send it again", status=503,
                    type="service_unavailable", code="engine_lost")


def stream_idle(seconds: float) -> ApiError:
    return ApiError(f"no output for {seconds:g}s; the request was ended", status=504, type="timeout")


def shutting_down() -> ApiError:
    return ApiError("the gateway is shutting down", status=503, type="service_unavailable")
