"""The scheduler's outputs to the detokenizers: each step's new tokens, and the error
output that ends a failed request. Traced requests' first and last outputs carry their
span's context (``request_traces.py``)."""

from __future__ import annotations

from shared.protocol import ENGINE_OUTPUTS_CHANNEL, EngineOutput, EngineOutputBatch, FinishReason
from shared.tracing import TRACED_BATCH_HEADER

from .request import Request
from .request_traces import RequestTraces
from .stop_strings_broadcast import StopStringsBroadcast

_TRACED = {TRACED_BATCH_HEADER: "1"}


class OutputPublisher:
    def __init__(self, engine_id: str, publish, spawn, stops: StopStringsBroadcast,
                 traces: RequestTraces | None = None) -> None:
        self.engine_id = engine_id
        self._publish = publish
        self._spawn = spawn
        self._stops = stops
        self._traces = traces

    async def publish(self, outputs: list[EngineOutput]) -> None:
        traces = self._traces
        headers = _TRACED if traces is not None and traces.requests and traces.on_outputs(outputs) else None
        await self._publish(ENGINE_OUTPUTS_CHANNEL, EngineOutputBatch(outputs, self.engine_id), headers=headers)

    def fail(self, requests: list[Request], error: str) -> None:
        """End these requests with ``error`` (published from a task)."""
        self._stops.ended(requests)
        outputs = [
            EngineOutput(
                request_id=request.request_id,
                gateway_id=request.gateway_id,
                new_token_ids=[],
                window_token_ids=[],
                window_offset=request.num_output_tokens,
                num_prompt_tokens=request.num_prompt_tokens,
                finish_reason=FinishReason.ERROR,
                error=error,
            )
            for request in requests
        ]
        if outputs:
            self._spawn(self.publish(outputs))
