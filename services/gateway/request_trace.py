"""One traced HTTP generation request at the gateway (``shared/tracing.py``).

The gateway's span is the trace's root, or a child of the client's ``traceparent``
header: ``POST /v1/chat/completions`` (SERVER), with children ``tokenize`` (CLIENT, one per
prompt: its context goes in the tokenize request's NATS headers, and the tokenizer's and
schedulers' spans hang under it) and ``stream out`` (first output to the end; ``collect
outputs`` when not streamed). The request's figures go on the server span as attributes
(vLLM's and OpenTelemetry GenAI's names): its id, model, tokens, TTFT, end-to-end time,
finish reasons. Only made when tracing is on (``GenerationEndpoint``).
"""

from __future__ import annotations

import time

from starlette.requests import Request

from shared.tracing import Attr, Tracing

OPERATIONS = {"chat": "chat", "completion": "text_completion"}  # gen_ai.operation.name


class RequestTrace:
    def __init__(self, tracing: Tracing, request: Request, kind: str) -> None:
        self.tracing = tracing
        self.kind = kind
        self.span = tracing.start(f"{request.method} {request.url.path}", tracing.context_from(request.headers),
                                  tracing.SERVER, attributes={
                                      "http.request.method": request.method, "url.path": request.url.path,
                                      Attr.OPERATION: OPERATIONS[kind], Attr.PROVIDER: "natsllm"})
        self.context = tracing.context_of(self.span)
        self.streamed = False
        self._ended = False

    def parsed(self, request_id: str, model: str, stream: bool, n: int, params) -> None:
        self.streamed = stream
        attributes = {Attr.REQUEST_ID: request_id, Attr.RESPONSE_ID: request_id, Attr.REQUEST_MODEL: model,
                      Attr.REQUEST_N: n, "gen_ai.request.stream": stream, Attr.TEMPERATURE: params.temperature,
                      Attr.TOP_P: params.top_p}
        if params.max_tokens is not None:
            attributes[Attr.MAX_TOKENS] = params.max_tokens
        if params.seed is not None:
            attributes[Attr.SEED] = params.seed
        self.span.set_attributes(attributes)

    def tokenize_span(self):
        """A span for one prompt's tokenize request; its W3C headers go with the request."""
        span = self.tracing.start("tokenize", self.context, self.tracing.CLIENT)
        return span, self.tracing.headers(span)

    def finish(self, generation, error: str = "", status: int = 200) -> None:
        """End the request's spans (once): ``generation`` holds its times and counts (None:
        it failed before one was made)."""
        if self._ended:
            return
        self._ended = True
        now_ns = time.time_ns()
        attributes = {"http.response.status_code": status}
        if generation is not None:
            attributes.update(self._generation_attributes(generation, now_ns))
        self.span.set_attributes(attributes)
        if error:
            self.tracing.fail(self.span, error)
        self.span.end(end_time=now_ns)

    def _generation_attributes(self, generation, now_ns: int) -> dict:
        def wall_ns(monotonic: float) -> int:
            return generation.created_ns + int((monotonic - generation.arrival) * 1e9)

        usage = generation.usage()
        reasons = [s.finish_reason.openai_name() for s in generation.streams if s.finish_reason]
        attributes = {
            Attr.PROMPT_TOKENS: usage["prompt_tokens"], Attr.INPUT_TOKENS: usage["prompt_tokens"],
            Attr.COMPLETION_TOKENS: usage["completion_tokens"], Attr.OUTPUT_TOKENS: usage["completion_tokens"],
            Attr.CACHED_TOKENS: usage["prompt_tokens_details"]["cached_tokens"],
            Attr.E2E: (now_ns - generation.created_ns) / 1e9, Attr.FINISH_REASONS: reasons,
        }
        if generation.first_token_at is not None:
            first_ns = wall_ns(generation.first_token_at)
            attributes[Attr.TIME_TO_FIRST_TOKEN] = (first_ns - generation.created_ns) / 1e9
            name = "stream out" if self.streamed else "collect outputs"
            self.tracing.record(name, self.context, first_ns, now_ns,
                                {Attr.OUTPUT_TOKENS: usage["completion_tokens"]})
        return attributes
