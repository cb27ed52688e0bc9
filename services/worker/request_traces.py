"""The worker's spans of traced requests (``shared/tracing.py``): its prefill and its decode.

With tracing on, a traced request's ``NewRequestData`` carries the W3C traceparent of its
``llm_request`` span at the scheduler (``trace_context``: once, when the workers first get
the request; no later step carries anything about traces). The worker notes, for those
requests only, the wall-clock span of each step that ran them on this rank, as prefill
(the step computed prompt tokens) or decode, and when the request leaves (the scheduler's
``finished_req_ids``, or a scheduler restart) makes two spans under the request's:

    worker prefill      first prefill step started -> last prefill step ended (steps, tokens)
    worker decode       first decode step started -> last step ended (steps)

Two spans per request and rank, however many steps: what tracing costs the worker does
not grow with the output length. With tracing off ``WorkerTraces`` is not made at all.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.protocol import SchedulerOutput
from shared.tracing import TRACEPARENT, Attr, Tracing


@dataclass
class _Phase:
    start_ns: int = 0
    end_ns: int = 0
    steps: int = 0
    tokens: int = 0

    def add(self, start_ns: int, end_ns: int, tokens: int) -> None:
        self.start_ns = self.start_ns or start_ns
        self.end_ns = end_ns
        self.steps += 1
        self.tokens += tokens


@dataclass
class _TracedRequest:
    parent: object
    prompt_len: int  # tokens to compute before the first new one (a resumed request's outputs too)
    num_computed: int
    prefill: _Phase
    decode: _Phase


class WorkerTraces:
    def __init__(self, tracing: Tracing, engine_id: str, rank: int) -> None:
        self.tracing = tracing
        self.attributes = {Attr.ENGINE: engine_id, "natsllm.rank": rank}
        self.requests: dict[str, _TracedRequest] = {}

    def step_ran(self, step: SchedulerOutput, start_ns: int, end_ns: int) -> None:
        """Note a step that ran on this rank from ``start_ns`` to ``end_ns`` (called for
        every step, in order, while tracing is on)."""
        if step.reset_state:
            self.end_all()
        for new in step.scheduled_new_reqs:
            if new.trace_context:
                self.requests[new.req_id] = _TracedRequest(
                    self.tracing.context_from({TRACEPARENT: new.trace_context}),
                    len(new.prompt_token_ids) + len(new.output_token_ids), new.num_computed_tokens, _Phase(), _Phase())
        if self.requests:
            cached = step.scheduled_cached_reqs
            for req_id, num_computed in zip(cached.req_ids, cached.num_computed_tokens):
                traced = self.requests.get(req_id)
                if traced is not None:
                    traced.num_computed = num_computed
            for req_id, num_tokens in zip(step.scheduled_req_ids, step.num_scheduled_tokens):
                traced = self.requests.get(req_id)
                if traced is None:
                    continue
                if traced.num_computed < traced.prompt_len:
                    traced.prefill.add(start_ns, end_ns, min(num_tokens, traced.prompt_len - traced.num_computed))
                else:
                    traced.decode.add(start_ns, end_ns, num_tokens)
                traced.num_computed += num_tokens
            for req_id in step.finished_req_ids:
                traced = self.requests.pop(req_id, None)
                if traced is not None:
                    self._end(traced)

    def end_all(self) -> None:
        """The spans of every request still held (a scheduler restart, the worker stopping)."""
        for traced in self.requests.values():
            self._end(traced)
        self.requests.clear()

    def _end(self, traced: _TracedRequest) -> None:
        for name, phase in (("worker prefill", traced.prefill), ("worker decode", traced.decode)):
            if phase.steps:
                self.tracing.record(name, traced.parent, phase.start_ns, phase.end_ns,
                                    {**self.attributes, f"{name.split()[1]}.steps": phase.steps,
                                     f"{name.split()[1]}.tokens": phase.tokens})
