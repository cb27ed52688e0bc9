"""The detokenizer service: each step's new token ids -> text deltas per gateway.

Between the scheduler and the gateways on the request's way. The scheduler
publishes every step's ``EngineOutputBatch`` on ``llm.detokenize`` (queue group:
any replica takes any step, since each output carries its own token window); the
service turns each ``EngineOutput`` into a ``StreamDelta`` with
``incremental.IncrementalDetokenizer``, groups them by gateway and publishes one
``StreamDeltaBatch`` per gateway on ``llm.stream.<gateway_id>``. A stop string that
ends a request also goes to every scheduler as an ``AbortRequest`` on its gateway's
abort subject (``llm.abort.<gateway_id>``), so its blocks are freed at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict

from nats.aio.msg import Msg

from shared.bus import Service
from shared.protocol import (
    ABORT_REQUEST,
    DETOKENIZE,
    ENGINE_OUTPUT_BATCH,
    STREAM_DELTA_BATCH,
    AbortRequest,
    EngineOutputBatch,
    FinishReason,
    StreamDelta,
    StreamDeltaBatch,
    engine_abort_subject,
    gateway_stream_subject,
)

from .incremental import IncrementalDetokenizer

logger = logging.getLogger(__name__)

# Batches with more window tokens than this are decoded in a thread, off the event loop.
THREAD_MIN_TOKENS = 2048


class DetokenizerService(Service):
    name = "detokenizer"

    def __init__(self, tokenizer, nats_url: str | None = None) -> None:
        super().__init__(nats_url)
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.num_outputs = 0
        self.num_stop_aborts = 0

    def info(self) -> dict:
        return {"num_outputs": self.num_outputs, "num_stop_aborts": self.num_stop_aborts}

    async def setup(self) -> None:
        await self.subscribe(DETOKENIZE, self._on_batch, queue="detokenizer")

    async def _on_batch(self, msg: Msg) -> None:
        # Awaited in the handler, not spawned: one replica publishes a request's deltas
        # in step order (the gateway re-orders by offset anyway).
        batch = ENGINE_OUTPUT_BATCH.decode(msg.data)
        if sum(len(o.window_token_ids) for o in batch.outputs) > THREAD_MIN_TOKENS:
            deltas, aborts = await asyncio.to_thread(self.detokenize, batch)
        else:
            deltas, aborts = self.detokenize(batch)
        for gateway_id, request_ids in aborts.items():
            # On the owner's subject: schedulers obey an abort only for that gateway's requests.
            self.num_stop_aborts += len(request_ids)
            await self.nc.publish(engine_abort_subject(gateway_id), ABORT_REQUEST.encode(AbortRequest(request_ids)))
        for gateway_id, gateway_deltas in deltas.items():
            await self.nc.publish(
                gateway_stream_subject(gateway_id), STREAM_DELTA_BATCH.encode(StreamDeltaBatch(gateway_deltas))
            )

    def detokenize(self, batch: EngineOutputBatch) -> tuple[dict[str, list[StreamDelta]], dict[str, list[str]]]:
        """Deltas, and the requests a stop string ended (to abort), grouped by gateway."""
        deltas: dict[str, list[StreamDelta]] = defaultdict(list)
        aborts: dict[str, list[str]] = defaultdict(list)
        for output in batch.outputs:
            self.num_outputs += 1
            try:
                result = self.detokenizer.process(output)
            except Exception as e:  # one bad output must not cost the other requests their step
                logger.exception("%s: detokenizing failed", output.request_id)
                deltas[output.gateway_id].append(self._error_delta(output, f"detokenizing failed: {e}"))
                if output.finish_reason == FinishReason.NONE:
                    aborts[output.gateway_id].append(output.request_id)
                continue
            if (result.stopped or result.already_stopped) and output.finish_reason == FinishReason.NONE:
                # The scheduler still runs it; repeated for late outputs in case an abort was lost.
                aborts[output.gateway_id].append(output.request_id)
            if result.already_stopped:
                continue
            num_new = len(output.new_token_ids)
            deltas[output.gateway_id].append(
                StreamDelta(
                    request_id=output.request_id,
                    token_offset=output.window_offset + len(output.window_token_ids) - num_new,
                    num_tokens=num_new,
                    text=result.text,
                    finish_reason=result.finish_reason,
                    num_prompt_tokens=output.num_prompt_tokens,
                    num_cached_tokens=output.num_cached_tokens,
                    logprobs=result.logprobs,
                    error=output.error,
                )
            )
        return deltas, aborts

    @staticmethod
    def _error_delta(output, error: str) -> StreamDelta:
        num_new = len(output.new_token_ids)
        return StreamDelta(
            request_id=output.request_id,
            token_offset=output.window_offset + len(output.window_token_ids) - num_new,
            num_tokens=num_new,
            text="",
            finish_reason=FinishReason.ERROR,
            num_prompt_tokens=output.num_prompt_tokens,
            num_cached_tokens=output.num_cached_tokens,
            error=error,
        )
