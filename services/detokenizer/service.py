"""The detokenizer service: each step's new token ids -> text deltas per gateway.

Between the scheduler and the gateways on the request's way. The scheduler
publishes every step's ``EngineOutputBatch`` on ``llm.detokenize`` (queue group:
any replica takes any step, since each output carries its own token window); the
service turns each ``EngineOutput`` into a ``StreamDelta`` with
``incremental.IncrementalDetokenizer``, groups them by gateway and publishes one
``StreamDeltaBatch`` per gateway on ``llm.stream.<gateway_id>``. A stop string that
ends a request also goes to every scheduler as an ``AbortRequest`` on its gateway's
abort subject (``llm.abort.<gateway_id>``), so its blocks are freed at once.

Stop strings do not come with each step: every replica hears each scheduler's
broadcast of them on ``llm.detokenize.stops`` (no queue group) and keeps them in a
bounded cache (``stop_strings.py``). An output flagged ``has_stop`` whose request is
not in the cache (the replica started later, the broadcast was lost, or the entry was
evicted) is looked up at the scheduler that made it (``llm.engine.<id>.stops``, one
query per batch, with a deadline); if none answers, that request's delta is an error
and the request is aborted: its text is never sent with its stop strings ignored.

Tracing (``shared/tracing.py``): a batch published with the scheduler's traced header
holds first or last outputs of traced requests, which carry their engine span's context
(``EngineOutput.trace_context``); each gets a ``detokenize`` span over the batch's
handling. Other batches are not looked at for traces.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict

import msgspec
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from prometheus_client import Histogram

from shared import tracing
from shared.bus import Service
from shared.protocol import (
    ABORT_CHANNEL,
    ENGINE_OUTPUTS_CHANNEL,
    STOP_STRINGS_CHANNEL,
    STOP_STRINGS_QUERY_CHANNEL,
    STREAM_CHANNEL,
    AbortRequest,
    EngineOutput,
    EngineOutputBatch,
    FinishReason,
    RequestStopStrings,
    StopStringsQuery,
    StreamDelta,
    StreamDeltaBatch,
)
from shared.service_metrics import counter
from shared.tracing import TRACED_BATCH_HEADER, TRACEPARENT, Attr

from .config import DetokenizerConfig
from .incremental import IncrementalDetokenizer
from .stop_strings import StopStringsCache

logger = logging.getLogger(__name__)

# Batches with more window tokens than this are decoded in a thread, off the event loop.
THREAD_MIN_TOKENS = 2048
BATCH_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class DetokenizerService(Service):
    name = "detokenizer"

    def __init__(self, tokenizer, config: DetokenizerConfig = DetokenizerConfig(),
                 nats_url: str | None = None) -> None:
        super().__init__(nats_url)
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.stop_strings = StopStringsCache(config.stop_strings_cache_chars)
        self.stop_strings_timeout = config.stop_strings_timeout
        self.num_outputs = 0
        self.num_stop_aborts = 0
        self.num_stop_queries = 0
        self.batch_seconds = Histogram("natsllm:detokenizer_batch_seconds",
                                       "Seconds to turn one step's outputs into text deltas and send them.",
                                       buckets=BATCH_BUCKETS, registry=self.metrics_registry)
        self.tracing = tracing.current()

    def info(self) -> dict:
        return {"num_outputs": self.num_outputs, "num_stop_aborts": self.num_stop_aborts,
                "num_stop_queries": self.num_stop_queries, "stop_strings_cached": len(self.stop_strings)}

    def metric_families(self):
        yield counter("natsllm:detokenizer_outputs", "Request outputs turned into text.", self.num_outputs)
        yield counter("natsllm:detokenizer_stop_aborts", "Requests a stop string ended.", self.num_stop_aborts)
        yield counter("natsllm:detokenizer_stop_queries", "Stop strings asked of a scheduler (missed broadcasts).",
                      self.num_stop_queries)

    async def setup(self) -> None:
        await self.subscribe(STOP_STRINGS_CHANNEL.subject(), self._on_stop_strings)
        await self.subscribe(ENGINE_OUTPUTS_CHANNEL.subject(), self._on_batch, queue="detokenizer")

    async def _on_stop_strings(self, msg: Msg) -> None:
        update = STOP_STRINGS_CHANNEL.decode(msg.data)
        for entry in update.added:
            self.stop_strings.put(entry)
        for request_id in update.finished:
            self.stop_strings.forget(request_id)

    async def _on_batch(self, msg: Msg) -> None:
        # Awaited in the handler, not spawned: one replica publishes a request's deltas
        # in step order (the gateway re-orders by offset anyway).
        started = time.perf_counter()
        started_ns = time.time_ns() if msg.headers and self.tracing is not None else 0
        batch = ENGINE_OUTPUTS_CHANNEL.decode(msg.data)
        stops, missing = await self._stop_strings_of(batch)
        if sum(len(o.window_token_ids) for o in batch.outputs) > THREAD_MIN_TOKENS:
            deltas, aborts = await asyncio.to_thread(self.detokenize, batch, stops, missing)
        else:
            deltas, aborts = self.detokenize(batch, stops, missing)
        for gateway_id, request_ids in aborts.items():
            # On the owner's subject: schedulers obey an abort only for that gateway's requests.
            self.num_stop_aborts += len(request_ids)
            await self.publish(ABORT_CHANNEL, AbortRequest(request_ids), gateway_id)
        for gateway_id, gateway_deltas in deltas.items():
            await self.publish(STREAM_CHANNEL, StreamDeltaBatch(gateway_deltas), gateway_id)
        self.batch_seconds.observe(time.perf_counter() - started)
        if started_ns and msg.headers.get(TRACED_BATCH_HEADER):
            self._record_spans(batch, started_ns)

    def _record_spans(self, batch: EngineOutputBatch, started_ns: int) -> None:
        """A ``detokenize`` span for each output that carries its request's trace context."""
        now = time.time_ns()
        for output in batch.outputs:
            if not output.trace_context:
                continue
            parent = self.tracing.context_from({TRACEPARENT: output.trace_context})
            self.tracing.record("detokenize", parent, started_ns, now, {
                Attr.REQUEST_ID: output.request_id, "detokenize.new_tokens": len(output.new_token_ids),
                "detokenize.batch_outputs": len(batch.outputs), Attr.ENGINE: batch.engine_id,
                "detokenize.finished": output.finish_reason != FinishReason.NONE})

    async def _stop_strings_of(self, batch: EngineOutputBatch) -> tuple[list[RequestStopStrings | None], str]:
        """Each output's stop strings and text settings (None: unknown here), and why some
        are unknown.

        Carried by the output, default (it has none), or cached; those the cache lacks
        are asked of the batch's scheduler (within ``stop_strings_timeout``). On the event
        loop: the cache is not shared with the decoding thread."""
        settings = [self._settings_of(o) for o in batch.outputs]
        unknown = [o.request_id for o, entry in zip(batch.outputs, settings) if entry is None]
        missing = ""
        answered: dict[str, RequestStopStrings] = {}
        deadline = time.monotonic() + self.stop_strings_timeout
        while unknown:  # a scheduler answers as many as fit one message: ask for the rest
            self.num_stop_queries += 1
            left = max(0.01, deadline - time.monotonic())
            try:
                # No responder (its scheduler moving to another node of the cluster, say) is asked again.
                answer = await self.request(STOP_STRINGS_QUERY_CHANNEL, StopStringsQuery(unknown), batch.engine_id,
                                            timeout=left, no_responders_window=left)
                added = answer.added
            except (NatsError, asyncio.TimeoutError, msgspec.DecodeError) as e:
                logger.warning("engine %s did not tell the stop strings of %s: %r", batch.engine_id, unknown, e)
                missing = (f"the detokenizer could not get this request's stop strings from engine "
                           f"{batch.engine_id!r} within {self.stop_strings_timeout:g}s")
                break
            for entry in added:
                answered[entry.request_id] = entry
                self.stop_strings.put(entry)
            if not added:
                missing = f"engine {batch.engine_id!r} does not know this request's stop strings"
                break
            unknown = [r for r in unknown if r not in answered]
        settings = [answered.get(o.request_id) if entry is None else entry
                    for o, entry in zip(batch.outputs, settings)]
        return settings, missing

    def _settings_of(self, output: EngineOutput) -> RequestStopStrings | None:
        if output.text_settings is not None:
            return output.text_settings
        if output.stop or not output.has_stop:
            return RequestStopStrings(output.request_id, output.stop)
        return self.stop_strings.get(output.request_id)

    def detokenize(self, batch: EngineOutputBatch, stops: list[RequestStopStrings | None],
                   missing: str = "") -> tuple[dict[str, list[StreamDelta]], dict[str, list[str]]]:
        """Deltas, and the requests a stop string ended (to abort), grouped by gateway.
        ``stops[i]``: output i's stop strings and text settings; None (unknown,
        ``missing`` says why) makes its delta an error and aborts the request."""
        deltas: dict[str, list[StreamDelta]] = defaultdict(list)
        aborts: dict[str, list[str]] = defaultdict(list)
        for output, stop in zip(batch.outputs, stops):
            self.num_outputs += 1
            if stop is None:
                # Never the text without its stop strings: the client would get text past them.
                logger.error("%s: %s; failing it", output.request_id, missing)
                deltas[output.gateway_id].append(self._error_delta(output, missing))
                if output.finish_reason == FinishReason.NONE:
                    aborts[output.gateway_id].append(output.request_id)
                continue
            try:
                result = self.detokenizer.process(output, stop)
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
                    stop_reason=result.stop_reason if result.finish_reason == FinishReason.STOP else None,
                    prompt_logprobs=result.prompt_logprobs,
                    engine_id=output.owner_engine_id,
                    incarnation=output.owner_incarnation,
                    token_ids=output.new_token_ids,
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
