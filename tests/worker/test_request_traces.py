"""The worker's spans of traced requests (services/worker/request_traces.py): one prefill and
one decode span per request, under the context its first step brought, ended when the
scheduler says the request left; with an in-memory exporter."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.worker.request_traces import WorkerTraces
from shared.protocol import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput
from shared.tracing import Attr, Tracing

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
ENGINE_SPAN = "00f067aa0ba902b7"


@pytest.fixture
def traced():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return WorkerTraces(Tracing(provider.get_tracer("test"), provider), "e0", 1), exporter


def new(req_id: str, traced: bool = True) -> NewRequestData:
    return NewRequestData(req_id, list(range(40)), SamplingParams(max_tokens=8), [0, 1, 2], 0,
                          trace_context=f"00-{TRACE_ID}-{ENGINE_SPAN}-01" if traced else "")


def step(step_id: int, scheduled: dict[str, int], new_reqs=(), computed: dict[str, int] | None = None,
         finished=(), reset: bool = False) -> SchedulerOutput:
    computed = computed or {}
    cached = CachedRequestData(list(computed), [False] * len(computed), [[]] * len(computed), list(computed.values()))
    return SchedulerOutput(step_id, scheduled_new_reqs=list(new_reqs), scheduled_cached_reqs=cached,
                           scheduled_req_ids=list(scheduled), num_scheduled_tokens=list(scheduled.values()),
                           total_num_scheduled_tokens=sum(scheduled.values()), finished_req_ids=list(finished),
                           reset_state=reset)


def test_a_request_gets_one_prefill_and_one_decode_span_under_its_engine_span(traced):
    traces, exporter = traced
    traces.step_ran(step(1, {"r": 32, "u": 32}, [new("r"), new("u", traced=False)]), 100, 200)  # first chunk
    assert set(traces.requests) == {"r"}
    traces.step_ran(step(2, {"r": 8, "u": 8}, computed={"r": 32, "u": 32}), 200, 300)  # last chunk
    for i in range(3):
        traces.step_ran(step(3 + i, {"r": 1, "u": 1}, computed={"r": 40 + i, "u": 40 + i}), 300 + 100 * i, 400 + 100 * i)
    assert not exporter.get_finished_spans()  # not before the request leaves
    traces.step_ran(step(6, {"u": 1}, finished=["r"]), 600, 700)
    assert not traces.requests
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"worker prefill", "worker decode"}
    prefill, decode = spans["worker prefill"], spans["worker decode"]
    for span in (prefill, decode):
        assert format(span.context.trace_id, "032x") == TRACE_ID and format(span.parent.span_id, "016x") == ENGINE_SPAN
        assert span.attributes[Attr.ENGINE] == "e0" and span.attributes["natsllm.rank"] == 1
    assert (prefill.start_time, prefill.end_time) == (100, 300)
    assert (prefill.attributes["prefill.steps"], prefill.attributes["prefill.tokens"]) == (2, 40)
    assert (decode.start_time, decode.end_time) == (300, 600) and decode.attributes["decode.steps"] == 3


def test_a_scheduler_restart_ends_the_spans_of_what_the_worker_held(traced):
    traces, exporter = traced
    traces.step_ran(step(1, {"r": 40}, [new("r")]), 100, 200)
    traces.step_ran(step(1, {}, reset=True), 300, 300)
    assert not traces.requests
    assert [s.name for s in exporter.get_finished_spans()] == ["worker prefill"]
