"""One HTTP generation request as the gateway runs it: fan-out, merged outputs, cleanup.

A request with ``P`` prompts and ``n`` samples becomes ``P * n`` engine requests,
``f"{request_id}-{p}-{i}"`` for choice ``p * n + i`` (a given seed becomes
``seed + i``, ``SamplingParams.for_choice``). ``start()`` sends the ``P`` prompts at
once, each as one ``TokenizeRequest`` carrying its ``n`` request ids (the tokenizer
prepares each prompt once); if any sample is refused, the request fails with the
first refusal (by choice index) and ``close()`` aborts the ones accepted. ``events()`` yields every choice's in-order deltas as they come,
until all choices end, the request's deadline passes or, once tokens flow, none
comes for ``stream_idle_timeout`` seconds, and records the
gateway-side metrics. ``close()`` (always called) aborts in the engine whatever
the engine has not ended itself: client gone, timeout, error, shutdown; and ends the
request's spans when it is traced (``request_trace.py``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from shared.aio import wait_for
from shared.protocol import ErrorInfo, FinishReason, StreamDelta, TokenizeRequest

from .errors import ApiError, request_timeout, stream_idle
from .openai_requests import GenerationRequest
from .bus_client import GatewayService
from .request_trace import RequestTrace
from .streams import RequestStream

Event = tuple[RequestStream, "StreamDelta | ErrorInfo"]


class Generation:
    def __init__(self, gateway: GatewayService, request: GenerationRequest, request_id: str,
                 trace: RequestTrace | None = None) -> None:
        self.gateway = gateway
        self.request = request
        self.request_id = request_id
        self.trace = trace
        self.created_ns = time.time_ns()
        self.created = self.created_ns // 10**9
        self.arrival = time.monotonic()
        self.first_token_at: float | None = None  # monotonic, the first token of any choice
        self.error = ""  # the message of an error that ended a choice (or the request)
        self.error_status = 500
        self.deadline = self.arrival + gateway.config.request_timeout
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        n = request.n
        self.streams = [
            RequestStream(f"{request_id}-{p}-{i}", p * n + i, p, self._events)
            for p in range(len(request.prompts))
            for i in range(n)
        ]
        self.prompt_tokens = [0] * len(request.prompts)
        self.prompt_token_ids: list[list[int]] = [[] for _ in request.prompts]  # return_token_ids
        self._refused: set[str] = set()  # ids the tokenizer turned down: nothing to abort
        self._last_token_time: dict[int, float] = {}
        self._closed = False

    # ------------------------------------------------------------------ start

    def prompt_streams(self) -> list[list[RequestStream]]:
        """The streams of each prompt, its samples in order."""
        n = self.request.n
        return [self.streams[p * n:(p + 1) * n] for p in range(len(self.request.prompts))]

    def tokenize_request(self, prompt_index: int, streams: list[RequestStream]) -> TokenizeRequest:
        """One prompt with its n samples (the tokenizer prepares it once)."""
        r = self.request
        return TokenizeRequest(
            request_ids=[s.request_id for s in streams],
            gateway_id=self.gateway.gateway_id,
            model=r.model,
            sampling_params=r.sampling_params,
            add_generation_prompt=r.add_generation_prompt,
            cache_salt=r.cache_salt,
            lora_request=r.lora_request,
            return_prompt_token_ids=r.return_token_ids,
            **r.prompts[prompt_index],
        )

    async def start(self) -> None:
        """Send every prompt with its samples; raises the first ``ApiError`` (by choice
        index) if any sample is refused."""
        groups = self.prompt_streams()
        requests = [self.tokenize_request(p, streams) for p, streams in enumerate(groups)]
        for request, streams in zip(requests, groups):
            for i, stream in enumerate(streams):  # what a resume sends again (resume.py)
                stream.prompt_request, stream.choice = request, i
        results = await asyncio.gather(
            *(self._tokenize(streams, request) for request, streams in zip(requests, groups)),
            return_exceptions=True,
        )
        errors = []
        for p, (streams, result) in enumerate(zip(groups, results)):
            if isinstance(result, BaseException):
                errors.append(result)
                if isinstance(result, ApiError) and not result.maybe_submitted:
                    self._refused.update(s.request_id for s in streams)
                continue
            self.prompt_tokens[p] = result.num_prompt_tokens
            self.prompt_token_ids[p] = result.prompt_token_ids
            for stream, choice in zip(streams, result.choices):
                if choice.error is None or self.gateway.waits_for_an_engine(stream, choice):
                    self.gateway.metrics.prompt_tokens.inc(result.num_prompt_tokens)
                else:
                    errors.append(ApiError.from_info(choice.error))
                    if choice.error.status != 503:  # a 503 may be a lost answer: it is aborted to be sure
                        self._refused.add(stream.request_id)
        for error in errors:
            if not isinstance(error, ApiError):
                raise error
        if errors:
            raise errors[0]

    async def _tokenize(self, streams: list[RequestStream], request: TokenizeRequest):
        if self.trace is None:
            return await self.gateway.tokenize(streams, request)
        span, headers = self.trace.tokenize_span()
        try:
            return await self.gateway.tokenize(streams, request, headers)
        except ApiError as e:
            self.trace.tracing.fail(span, e.info.message)
            raise
        finally:
            span.end()

    # ------------------------------------------------------------------ outputs

    async def events(self) -> AsyncIterator[Event]:
        """Each choice's deltas in token order, the choices interleaved as they arrive; a
        choice's last event has a finish reason or is an ``ErrorInfo``."""
        config = self.gateway.config
        remaining = len(self.streams)
        timed_out = False
        last_output: float | None = None  # the idle timeout is armed by the first token
        while remaining:
            # After a timeout every unfinished stream holds its error event: no wait.
            deadline = self.deadline
            if config.stream_idle_timeout and last_output is not None:
                deadline = min(deadline, last_output + config.stream_idle_timeout)
            timeout = None if timed_out else max(0.0, deadline - time.monotonic())
            try:
                stream, item = await wait_for(self._events.get(), timeout)
            except asyncio.TimeoutError:
                timed_out = True
                if time.monotonic() >= self.deadline:
                    error = request_timeout(config.request_timeout).info
                else:
                    error = stream_idle(config.stream_idle_timeout).info
                for s in self.streams:
                    s.fail(error)
                continue
            now = time.monotonic()
            if not isinstance(item, ErrorInfo) and item.num_tokens:
                last_output = now
            if isinstance(item, ErrorInfo):
                remaining -= 1
                self.error = item.message
                self.gateway.metrics.finished("error", now - self.arrival)
            else:
                self._observe(stream, item, now)
                if item.finish_reason != FinishReason.NONE:
                    remaining -= 1
            yield stream, item

    def _observe(self, stream: RequestStream, delta: StreamDelta, now: float) -> None:
        metrics = self.gateway.metrics
        if delta.num_tokens:
            last = self._last_token_time.get(stream.index)
            if last is None:
                metrics.time_to_first_token.observe(now - self.arrival)
                if self.first_token_at is None:
                    self.first_token_at = now
            else:
                metrics.inter_token_latency.observe(now - last)
            self._last_token_time[stream.index] = now
            metrics.generation_tokens.inc(delta.num_tokens)
        if delta.finish_reason != FinishReason.NONE:
            metrics.finished(FinishReason(delta.finish_reason).openai_name(), now - self.arrival)

    def usage(self) -> dict:
        """OpenAI usage: each prompt counted once however many samples it had."""
        cached = [0] * len(self.prompt_tokens)
        prompt_tokens = list(self.prompt_tokens)
        for s in self.streams:
            cached[s.prompt_index] = max(cached[s.prompt_index], s.num_cached_tokens)
            if not prompt_tokens[s.prompt_index]:
                prompt_tokens[s.prompt_index] = s.num_prompt_tokens
        completion_tokens = sum(s.num_output_tokens for s in self.streams)
        usage = {
            "prompt_tokens": sum(prompt_tokens),
            "completion_tokens": completion_tokens,
            "total_tokens": sum(prompt_tokens) + completion_tokens,
        }
        if self.gateway.config.enable_prompt_tokens_details:
            usage["prompt_tokens_details"] = {"cached_tokens": sum(cached)}
        return usage

    # ------------------------------------------------------------------ cleanup

    def close(self) -> None:
        """Forget the streams; abort in the engine every request it has not ended.
        Synchronous, so a cancelled handler's ``finally`` cannot lose it."""
        if self._closed:
            return
        self._closed = True
        if self.trace is not None:
            self.trace.finish(self, self.error, self.error_status if self.error else 200)
        to_abort = []
        for s in self.streams:
            self.gateway.release(s)
            if not s.engine_done and s.request_id not in self._refused:
                to_abort.append(s.request_id)
        self.gateway.abort_soon(to_abort)
