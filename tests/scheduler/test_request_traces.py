"""The scheduler's spans of traced requests (services/scheduler/request_traces.py), made from
the steps' times when a request leaves the engine, with an in-memory exporter."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from services.scheduler.request_traces import RequestTraces
from shared.protocol import EngineOutput, EngineRequest, FinishReason, ModelRunnerOutput, SamplingParams, \
    SchedulerOutput
from shared.step_profile import WORKER_PHASES
from shared.tracing import Attr, Tracing

PARENT = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}


@pytest.fixture
def traced():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return RequestTraces(Tracing(provider.get_tracer("test"), provider), "e0"), exporter


def request(request_id: str = "r") -> EngineRequest:
    return EngineRequest(request_id, list(range(40)), SamplingParams(max_tokens=8, temperature=0.5))


def step(traces: RequestTraces, tokens: int, sampled: list[int], req_id: str = "r", timings=()) -> None:
    traces.step_done(SchedulerOutput(1, scheduled_req_ids=[req_id], num_scheduled_tokens=[tokens]), 1,
                     ModelRunnerOutput(1, req_ids=[req_id], sampled_token_ids=[sampled], timings=list(timings)))


def output(new: list[int], offset: int, finish=FinishReason.NONE, owner: str = "") -> EngineOutput:
    return EngineOutput("r", "g", new, new, offset, 40, finish_reason=finish, owner_engine_id=owner)


def spans(exporter) -> dict:
    return {s.name: s for s in exporter.get_finished_spans()}


def test_a_request_gets_queue_prefill_chunks_and_decode_under_its_engine_span(traced):
    traces, exporter = traced
    traces.arrived(request(), {})  # no context: not traced
    assert not traces.requests
    traces.arrived(request(), PARENT)
    timings = [0.001 * (i + 1) for i in range(len(WORKER_PHASES))]
    step(traces, 32, [], timings=timings)  # the prompt's first chunk
    step(traces, 8, [7], timings=timings)  # its last chunk: the first token
    first = output([7], 0)
    assert traces.on_outputs([first]) and first.trace_context.split("-")[1] == "4bf92f3577b34da6a3ce929d0e0e4736"
    step(traces, 1, [8])
    middle = output([8], 1)
    assert not traces.on_outputs([middle]) and middle.trace_context == ""  # only the first and the last
    step(traces, 1, [9])
    last = output([9], 2, FinishReason.LENGTH)
    assert traces.on_outputs([last]) and last.trace_context and not traces.requests
    by_name = spans(exporter)
    engine = by_name["llm_request"]
    assert format(engine.parent.span_id, "016x") == "00f067aa0ba902b7"
    for name in ("queue", "prefill", "decode"):
        assert by_name[name].parent.span_id == engine.context.span_id
    chunks = [s for s in exporter.get_finished_spans() if s.name == "prefill chunk"]
    assert [c.attributes["prefill.chunk_tokens"] for c in chunks] == [32, 8]
    assert all(c.parent.span_id == by_name["prefill"].context.span_id for c in chunks)
    assert by_name["decode"].attributes["decode.tokens"] == 2
    attributes = engine.attributes
    assert attributes[Attr.COMPLETION_TOKENS] == 3 and attributes[Attr.PROMPT_TOKENS] == 40
    assert attributes[Attr.FINISH_REASONS] == ("length",) and attributes[Attr.ENGINE] == "e0"
    assert attributes[Attr.TIME_IN_MODEL_FORWARD] == pytest.approx(2 * timings[WORKER_PHASES.index("forward")])
    assert attributes[Attr.TIME_IN_MODEL_EXECUTE] == pytest.approx(2 * sum(timings))
    assert attributes[Attr.TEMPERATURE] == 0.5 and attributes[Attr.MAX_TOKENS] == 8


def test_pd_the_prefill_engine_ends_with_the_hand_off_and_the_decode_engine_goes_on(traced):
    traces, exporter = traced
    traces.arrived(request(), PARENT)
    step(traces, 40, [7])
    handed = output([7], 0, owner="decode-0")
    assert traces.on_outputs([handed]) and not traces.requests
    prefill_side = spans(exporter)
    assert "kv hand-off" in prefill_side and "decode" not in prefill_side
    assert prefill_side["kv hand-off"].attributes["kv.decode_engine"] == "decode-0"
    # The decode engine continues the trace under the prefill engine's span.
    exporter.clear()
    context = prefill_side["llm_request"].context
    handoff_headers = {"traceparent": f"00-{context.trace_id:032x}-{context.span_id:016x}-01"}
    traces.arrived(request(), handoff_headers, handed_in=True)
    traces.kv_loaded(["r"])
    step(traces, 1, [8])
    assert traces.on_outputs([output([8], 1, FinishReason.STOP)])
    decode_side = spans(exporter)
    assert decode_side["llm_request"].parent.span_id == prefill_side["llm_request"].context.span_id
    assert {"kv transfer", "decode", "queue"} <= set(decode_side) and "prefill" not in decode_side


def test_an_aborted_request_ends_its_span_as_failed(traced):
    traces, exporter = traced
    traces.arrived(request(), PARENT)
    traces.forget_gone(lambda req_id: req_id == "other")
    [engine] = [s for s in exporter.get_finished_spans() if s.name == "llm_request"]
    assert engine.status.status_code == StatusCode.ERROR and not traces.requests


def test_the_workers_get_a_traced_requests_context_once_with_its_first_step(traced):
    from shared.protocol import NewRequestData

    traces, _ = traced
    traces.arrived(request(), PARENT)
    sent = SchedulerOutput(1, scheduled_new_reqs=[NewRequestData("r", list(range(40)), SamplingParams(), [0], 0),
                                                  NewRequestData("other", [1], SamplingParams(), [1], 0)])
    traces.mark_new(sent)
    engine_span = traces.requests["r"].span.get_span_context()
    assert sent.scheduled_new_reqs[0].trace_context == \
        f"00-4bf92f3577b34da6a3ce929d0e0e4736-{engine_span.span_id:016x}-01"
    assert sent.scheduled_new_reqs[1].trace_context == ""
