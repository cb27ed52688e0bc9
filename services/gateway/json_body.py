"""Reads a request's JSON body within limits, so no body can cost a 500 or unbounded memory.

The body is read in chunks and refused with 413 as soon as it passes the size cap
(a ``Content-Length`` over the cap is refused before reading). What is read must be
UTF-8 JSON (else 400), nested at most ``MAX_JSON_DEPTH`` deep, with every integer in
the signed 64-bit range: larger ones cannot travel in a msgpack message and no field
has a use for them. Every refusal is an ``ApiError`` with OpenAI's error body.
"""

from __future__ import annotations

import msgspec
from starlette.requests import ClientDisconnect, Request

from .errors import ApiError, invalid

MAX_JSON_DEPTH = 64
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class ClientGone(Exception):
    """The HTTP client disconnected before the answer was ready."""


def body_too_large(limit: int) -> ApiError:
    return ApiError(f"the request body is larger than the limit of {limit} bytes", status=413,
                    code="request_too_large")


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The raw body, at most ``max_bytes`` long; ``ClientGone`` if the client left."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise body_too_large(max_bytes)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise body_too_large(max_bytes)
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone() from None
    return b"".join(chunks)


def decode_json(body: bytes):
    """The decoded JSON value, or a 400 that says what is wrong with it."""
    try:
        value = msgspec.json.decode(body)
    except msgspec.DecodeError as e:
        raise invalid(f"the request body is not valid JSON: {e}") from None
    except UnicodeDecodeError:
        raise invalid("the request body is not valid UTF-8") from None
    except RecursionError:
        raise invalid(f"the request body is nested deeper than {MAX_JSON_DEPTH} levels") from None
    check_json_limits(value)
    return value


def check_json_limits(value) -> None:
    """Depth and integer range, walked without recursion."""
    pending = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise invalid(f"the request body is nested deeper than {MAX_JSON_DEPTH} levels")
            children = item.values() if isinstance(item, dict) else item
            pending.extend((child, depth + 1) for child in children)
        elif isinstance(item, int) and not isinstance(item, bool) and not _INT64_MIN <= item <= _INT64_MAX:
            raise invalid("the request body has an integer outside the signed 64-bit range")


async def read_json(request: Request, max_bytes: int):
    return decode_json(await read_body(request, max_bytes))
