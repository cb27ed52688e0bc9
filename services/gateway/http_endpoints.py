"""``POST /v1/chat/completions`` and ``POST /v1/completions``: parse, run, answer.

Tokenize errors come back before any byte is sent, with their own status, for
streamed requests too. A streamed answer is SSE (``data: {json}`` blocks, then
``data: [DONE]``); an error after the stream began is sent as a
``data: {"error": ...}`` block, as vLLM does. Whatever way a request ends — done,
client gone, error, timeout — ``Generation.close()`` runs and aborts in the
engine what is still running there.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from shared import tracing
from shared.protocol import ErrorInfo

from .errors import ApiError, error_body, error_response, json_response
from .generation import Generation
from .json_body import ClientGone, read_json
from .lora_routes import with_lora_adapter
from .openai_requests import GenerationRequest, parse_chat, parse_completion
from .openai_responses import ChoiceResult, ResponseFormat, response_format
from .request_trace import RequestTrace
from .stream_interval import ChunkInterval
from .tool_choice import require_tool_parser
from .bus_client import GatewayService

logger = logging.getLogger(__name__)

_json = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"
# A client that went away gets no response; 499 is what the access log shows.
CLIENT_CLOSED = 499


def sse(obj) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


async def until_disconnected(request: Request, work: Awaitable):
    """Run ``work``; if the client disconnects first, cancel it and raise ``ClientGone``."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # cancelled from outside (server shutdown)
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    raise ClientGone()


async def _wait_disconnect(request: Request) -> None:
    # After the body is read, the server's receive() only returns on disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


class GenerationStream(StreamingResponse):
    """SSE response that runs ``on_close`` however it ends (done, client gone, cancelled)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


class GenerationEndpoint:
    """One of the two generation routes; ``kind`` is "chat" or "completion"."""

    def __init__(self, gateway: GatewayService, kind: str) -> None:
        self.gateway = gateway
        self.kind = kind
        self.parse: Callable[..., GenerationRequest] = parse_chat if kind == "chat" else parse_completion
        self.id_prefix = "chatcmpl" if kind == "chat" else "cmpl"

    async def endpoint(self, request: Request) -> Response:
        """The Starlette endpoint: every failure becomes an OpenAI error answer. Traced
        (tracing on): the request's spans end with the generation, or here if none began."""
        process_tracing = tracing.current()
        trace = RequestTrace(process_tracing, request, self.kind) if process_tracing is not None else None
        try:
            return await self.handle(request, trace)
        except ApiError as e:
            if trace is not None:
                trace.finish(None, e.info.message, e.info.status)
            return error_response(e.info)
        except ClientGone:
            if trace is not None:
                trace.finish(None, "client gone", CLIENT_CLOSED)
            return Response(status_code=CLIENT_CLOSED)
        except BaseException as e:
            if trace is not None:
                trace.finish(None, repr(e), 500)
            raise

    async def handle(self, request: Request, trace: RequestTrace | None = None) -> Response:
        body = await read_json(request, self.gateway.config.max_request_body_bytes)
        config = self.gateway.config
        parsed = with_lora_adapter(self.gateway, body, self.parse)
        if config.return_tokens_as_token_ids and body.get("return_tokens_as_token_ids") is None:
            params = msgspec.structs.replace(parsed.sampling_params, return_tokens_as_token_ids=True)
            parsed = dataclasses.replace(parsed, sampling_params=params)
        if parsed.tool_calling is not None:
            calling = require_tool_parser(parsed.tool_calling, config.enable_auto_tool_choice, config.tool_call_parser)
            parsed = dataclasses.replace(parsed, tool_calling=calling)
        request_id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        if trace is not None:
            trace.parsed(request_id, parsed.model, parsed.stream, parsed.n, parsed.sampling_params)
        generation = Generation(self.gateway, parsed, request_id, trace)
        client_id = request.headers.get("x-request-id") or parsed.client_request_id
        response_id = f"{self.id_prefix}-{client_id}" if client_id else generation.request_id
        fmt = response_format(self.kind, response_id, generation.created, parsed, generation.prompt_token_ids)
        try:
            await until_disconnected(request, generation.start())
            if parsed.stream:
                # From here the response owns the generation and closes it when done.
                return GenerationStream(self.stream(generation, fmt), on_close=generation.close)
        except BaseException as e:
            if isinstance(e, ApiError):
                generation.error, generation.error_status = e.info.message, e.info.status
            generation.close()
            raise
        try:
            return json_response(await until_disconnected(request, self.collect(generation, fmt)))
        finally:
            generation.close()

    async def stream(self, generation: Generation, fmt: ResponseFormat) -> AsyncIterator[bytes]:
        for chunk in fmt.opening():
            yield sse(chunk)
        # Tokens per chunk: the request's stream_interval, at least the server's.
        interval = ChunkInterval(max(generation.request.stream_interval, self.gateway.config.stream_interval))
        async for stream, item in generation.events():
            if isinstance(item, ErrorInfo):
                for index, held in interval.flush():  # what the client would have had by now
                    chunk = fmt.chunk(index, held)
                    if chunk is not None:
                        yield sse(chunk)
                logger.warning("%s: ended with an error: %s", stream.request_id, item.message)
                yield sse(error_body(item))
                break
            delta = interval.add(stream.index, item)
            chunk = None if delta is None else fmt.chunk(stream.index, delta)
            if chunk is not None:
                yield sse(chunk)
        else:
            if generation.request.include_usage:
                yield sse(fmt.usage_chunk(generation.usage()))
        yield DONE

    async def collect(self, generation: Generation, fmt: ResponseFormat) -> dict:
        results = [ChoiceResult() for _ in generation.streams]
        async for stream, item in generation.events():
            if isinstance(item, ErrorInfo):
                logger.warning("%s: ended with an error: %s", stream.request_id, item.message)
                raise ApiError.from_info(item)
            results[stream.index].add(item)
        return fmt.response(results, generation.usage())
