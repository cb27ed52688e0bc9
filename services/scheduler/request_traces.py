"""The scheduler's spans of traced requests (``shared/tracing.py``): queue, prefill, decode.

A request arrives traced when its engine request (or P/D hand-off) carries a W3C
``traceparent`` in its NATS headers and this process traces. Its ``llm_request`` span
starts then, as a child of the tokenizer's route span (or of the prefill engine's span,
for a hand-off). The steps carry only, in a traced request's ``NewRequestData`` (the
first step the workers get it in), that span's context: the workers make their spans of
its prefill and decode under it (``services/worker/request_traces.py``). The scheduler
notes, for the traced
requests of each step only, when the step went out and its result came back; the
children are made when the request leaves the engine, from those times, as vLLM makes its
request span from the request's timestamps:

    llm_request             arrival -> finished (or handed off, or aborted)
      queue                 arrival -> first scheduled
      kv transfer           (P/D decode side) arrival -> its prompt's KV loaded
      prefill               first scheduled -> first token
        prefill chunk       one per step that computed part of the prompt
      kv hand-off           (P/D prefill side) first token -> a decode engine took it
      decode                first token -> finished (steps and tokens as attributes)

A step's time is counted from when it was sent, or from the result of the step before
it when that came later (with async scheduling the next step waits at the workers).
With ``--collect-detailed-traces`` the workers time their steps (``ModelRunnerOutput.
timings``), and each request's span adds up the forward and execute times of its steps
(vLLM's ``gen_ai.latency.time_in_model_forward`` / ``_execute``).

The first and the last output of a traced request carry its span's context
(``EngineOutput.trace_context``) so the detokenizer's spans join the trace; a batch with
any is published with the ``TRACED_BATCH_HEADER`` NATS header, so the detokenizer looks at its
outputs only then. With tracing off ``RequestTraces`` is not made at all.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from shared.protocol import EngineOutput, EngineRequest, FinishReason, ModelRunnerOutput, SchedulerOutput
from shared.step_profile import WORKER_PHASES
from shared.tracing import Attr, Tracing
_FORWARD = WORKER_PHASES.index("forward")


@dataclass
class TracedRequest:
    span: object
    request: EngineRequest
    arrival_ns: int
    handed_in: bool = False  # P/D decode side: came by hand-off
    first_scheduled_ns: int = 0
    first_token_ns: int = 0
    kv_loaded_ns: int = 0
    chunks: list[tuple[int, int, int]] = field(default_factory=list)  # prefill steps: start, end, tokens
    decode_steps: int = 0
    decode_tokens: int = 0
    model_forward_s: float = 0.0
    model_execute_s: float = 0.0
    first_output_sent: bool = False
    num_cached_tokens: int = 0


class RequestTraces:
    def __init__(self, tracing: Tracing, engine_id: str) -> None:
        self.tracing = tracing
        self.engine_id = engine_id
        self.requests: dict[str, TracedRequest] = {}
        self._last_result_ns = 0

    # ------------------------------------------------------------------ arrival

    def arrived(self, request: EngineRequest, headers, handed_in: bool = False) -> None:
        """A request this engine queued; traced when ``headers`` carry a sampled context."""
        parent = self.tracing.context_from(headers)
        if parent is None:
            return
        now = time.time_ns()
        params = request.sampling_params
        attributes = {
            Attr.REQUEST_ID: request.request_id, Attr.ENGINE: self.engine_id,
            Attr.PROMPT_TOKENS: len(request.prompt_token_ids), Attr.INPUT_TOKENS: len(request.prompt_token_ids),
            Attr.TEMPERATURE: params.temperature, Attr.TOP_P: params.top_p,
        }
        if params.max_tokens is not None:
            attributes[Attr.MAX_TOKENS] = params.max_tokens
        span = self.tracing.start("llm_request", parent, self.tracing.SERVER, now, attributes)
        if span.is_recording():
            self.requests[request.request_id] = TracedRequest(span, request, now, handed_in)

    def headers(self, request_id: str) -> dict[str, str] | None:
        """The W3C headers of a traced request's span (a hand-off continues its trace)."""
        traced = self.requests.get(request_id)
        return None if traced is None else self.tracing.headers(traced.span)

    # ------------------------------------------------------------------ steps

    def mark_new(self, step: SchedulerOutput) -> None:
        """Give each traced request the workers get for the first time in ``step`` its
        span's context, under which they make theirs (``services/worker/request_traces.py``)."""
        for new in step.scheduled_new_reqs:
            traced = self.requests.get(new.req_id)
            if traced is not None:
                new.trace_context = self.tracing.traceparent(traced.span)

    def step_done(self, step: SchedulerOutput, sent_ns: int, result: ModelRunnerOutput) -> None:
        """Note a step's times for its traced requests (called only while some are)."""
        now = time.time_ns()
        start = max(sent_ns, self._last_result_ns)
        self._last_result_ns = now
        sampled = dict(zip(result.req_ids, result.sampled_token_ids))
        timings = result.timings
        for req_id, num_tokens in zip(step.scheduled_req_ids, step.num_scheduled_tokens):
            traced = self.requests.get(req_id)
            if traced is None:
                continue
            if not traced.first_scheduled_ns:
                traced.first_scheduled_ns = sent_ns
            if timings:  # the whole batch's times count for each of its requests, as in vLLM
                traced.model_forward_s += timings[_FORWARD]
                traced.model_execute_s += sum(timings)
            new_tokens = len(sampled.get(req_id) or ())
            if traced.first_token_ns or traced.handed_in:  # a hand-off came with its first token
                traced.decode_steps += 1
                traced.decode_tokens += new_tokens
                continue
            traced.chunks.append((start, now, num_tokens))
            if new_tokens:
                traced.first_token_ns = now
                traced.decode_tokens += new_tokens - 1

    def kv_loaded(self, request_ids) -> None:
        now = time.time_ns()
        for req_id in request_ids:
            traced = self.requests.get(req_id)
            if traced is not None and not traced.kv_loaded_ns:
                traced.kv_loaded_ns = now

    # ------------------------------------------------------------------ outputs

    def on_outputs(self, outputs: list[EngineOutput]) -> bool:
        """Mark the first and the last output of each traced request with its context, and
        end the spans of the requests that left (finished, or handed to a decode engine).
        Returns whether any output was marked."""
        marked = False
        for output in outputs:
            traced = self.requests.get(output.request_id)
            if traced is None:
                continue
            ended = output.finish_reason != FinishReason.NONE or bool(output.owner_engine_id)
            if output.num_cached_tokens:
                traced.num_cached_tokens = output.num_cached_tokens
            if (output.new_token_ids and not traced.first_output_sent) or ended:
                output.trace_context = self.tracing.traceparent(traced.span)
                traced.first_output_sent = traced.first_output_sent or bool(output.new_token_ids)
                marked = True
            if ended:
                del self.requests[output.request_id]
                self._end(traced, output)
        return marked

    def forget_gone(self, known) -> None:
        """End the spans of traced requests the engine no longer holds (aborted, or lost
        with a failed engine): ``known(request_id)`` says whether it still does."""
        for req_id in [r for r in self.requests if not known(r)]:
            traced = self.requests.pop(req_id)
            self.tracing.fail(traced.span, "aborted")
            self._end(traced, None)

    def _end(self, traced: TracedRequest, output: EngineOutput | None) -> None:
        tracing, span = self.tracing, traced.span
        now = time.time_ns()
        parent = tracing.context_of(span)
        first_scheduled = traced.first_scheduled_ns or now
        first_token = traced.first_token_ns
        tracing.record("queue", parent, traced.arrival_ns, first_scheduled)
        if traced.handed_in and traced.kv_loaded_ns:
            tracing.record("kv transfer", parent, traced.arrival_ns, traced.kv_loaded_ns)
        if traced.chunks:
            prefill_end = first_token or traced.chunks[-1][1]
            prefill = tracing.start("prefill", parent, start_ns=first_scheduled,
                                    attributes={"prefill.chunks": len(traced.chunks)})
            prefill_context = tracing.context_of(prefill)
            for i, (start, end, num_tokens) in enumerate(traced.chunks):
                tracing.record("prefill chunk", prefill_context, start, end,
                               {"prefill.chunk": i, "prefill.chunk_tokens": num_tokens})
            prefill.end(end_time=prefill_end)
        handed_off = output is not None and bool(output.owner_engine_id)
        if handed_off and first_token:
            tracing.record("kv hand-off", parent, first_token, now, {"kv.decode_engine": output.owner_engine_id})
        elif first_token or traced.handed_in:
            start = first_token or traced.kv_loaded_ns or first_scheduled
            tracing.record("decode", parent, start, now,
                           {"decode.steps": traced.decode_steps, "decode.tokens": traced.decode_tokens})
        self._set_request_attributes(traced, output, now)
        if output is not None and output.finish_reason == FinishReason.ERROR:
            tracing.fail(span, output.error or "error")
        span.end(end_time=now)

    def _set_request_attributes(self, traced: TracedRequest, output: EngineOutput | None, now: int) -> None:
        """vLLM's latency attributes (seconds), from the request's arrival at the engine
        (its tokenizer's time when known, as vLLM counts from the API server's arrival)."""
        arrival_ns = int(traced.request.arrival_time * 1e9) if traced.request.arrival_time else traced.arrival_ns
        first_scheduled = traced.first_scheduled_ns or now
        attributes = {
            Attr.TIME_IN_QUEUE: (first_scheduled - traced.arrival_ns) / 1e9,
            Attr.E2E: (now - arrival_ns) / 1e9,
            Attr.CACHED_TOKENS: traced.num_cached_tokens,
        }
        if traced.first_token_ns:
            attributes[Attr.TIME_TO_FIRST_TOKEN] = (traced.first_token_ns - arrival_ns) / 1e9
            attributes[Attr.TIME_IN_MODEL_PREFILL] = (traced.first_token_ns - first_scheduled) / 1e9
            attributes[Attr.TIME_IN_MODEL_DECODE] = (now - traced.first_token_ns) / 1e9
        attributes[Attr.TIME_IN_MODEL_INFERENCE] = (now - first_scheduled) / 1e9
        if traced.model_execute_s:
            attributes[Attr.TIME_IN_MODEL_FORWARD] = traced.model_forward_s
            attributes[Attr.TIME_IN_MODEL_EXECUTE] = traced.model_execute_s
        if output is not None:
            num_output = output.window_offset + len(output.window_token_ids)
            attributes[Attr.COMPLETION_TOKENS] = attributes[Attr.OUTPUT_TOKENS] = num_output
            if output.finish_reason != FinishReason.NONE:
                attributes[Attr.FINISH_REASONS] = [FinishReason(output.finish_reason).openai_name()]
        traced.span.set_attributes(attributes)
