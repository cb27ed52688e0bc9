"""The gateway's bus side: tokenize requests out, text deltas in, aborts out.

First and last stop on the request's way. Each gateway replica subscribes, before
it sends any request, to its own subject ``llm.stream.<gateway_id>`` (no queue
group: only this replica holds the HTTP streams). On an authenticated bus the id is
its NATS user's (``gateway-<id>``, shared/bus_auth.py), the only stream subject that
user may read. For each engine request it registers a ``RequestStream`` under the
request id, then asks a tokenizer on ``llm.tokenize`` (request/reply), one request per
prompt with its samples' ids. Deltas for ids it does not hold (finished, aborted) are
dropped. Requests that end early are aborted on ``llm.abort.<gateway_id>``, lost
outputs asked for again on ``llm.resend.<gateway_id>``. ``EngineStats`` from
``llm.engine.stats`` feed /metrics and tell which engines restarted or went silent:
their requests resume on another engine (``resume.py``); every replica's
``ServiceStatus`` from ``llm.status.*`` feeds the fleet /dashboard shows (``fleet.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.errors import MaxPayloadError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from shared.bus import NO_RESPONDERS_WINDOW, Service, flush_in_order
from shared.bus_auth import gateway_id_from_credentials
from shared.config import ConfigError
from shared.protocol import (
    ABORT_CHANNEL,
    ENGINE_STATS_CHANNEL,
    PING_CHANNEL,
    RESEND_CHANNEL,
    ROUTER_STATS_CHANNEL,
    SERVICE_RESTARTS_CHANNEL,
    SERVICE_STATUS_CHANNEL,
    STREAM_CHANNEL,
    TOKENIZE,
    TOKENIZE_CHANNEL,
    AbortRequest,
    EngineRequestReply,
    ResendOutputs,
    TokenizeReply,
    TokenizeRequest,
)

from .config import GatewayConfig
from .errors import ApiError, bus_unavailable, engine_lost, no_tokenizer, shutting_down, tokenizer_timeout
from .fleet import Fleet
from .lora_routes import LoRARegistry, join_lora_bus
from .metrics import ENGINE_STATS_TTL, EngineStatsStore, GatewayMetrics, RouterStatsStore
from .resume import Resumer
from .streams import RequestStream

logger = logging.getLogger(__name__)

TOKENIZE_ATTEMPTS = 2
# Seconds deltas may wait behind a missing one before the engine is asked to resend it.
GAP_TIMEOUT = 1.0
# Seconds without any delta after which a stream asks for a resend anyway (a lost last delta).
STALL_TIMEOUT = 5.0


class GatewayService(Service):
    name = "gateway"

    def __init__(self, config: GatewayConfig, nats_url: str | None = None, instance_id: str | None = None) -> None:
        # On an authenticated bus the id is the gateway's NATS user's: its only stream subject.
        bus_id = gateway_id_from_credentials()
        if instance_id and bus_id and instance_id != bus_id:
            raise ConfigError(f"gateway id {instance_id!r} differs from its NATS user's ({bus_id!r})")
        super().__init__(nats_url, instance_id or bus_id)
        self.config = config
        self.streams: dict[str, RequestStream] = {}
        self.engine_stats = EngineStatsStore()
        self.fleet = Fleet()
        self.router_stats = RouterStatsStore()
        self.metrics = GatewayMetrics(config.model_name, self.engine_stats, self.router_stats, self.metrics_registry)
        self.closing = False
        self.num_dropped_deltas = 0
        self.num_resends = 0
        self.lora = LoRARegistry(config.lora, config.model) if config.lora.enable_lora else None
        self.resumer = Resumer(self)

    @property
    def gateway_id(self) -> str:
        return self.instance_id

    def info(self) -> dict:
        return {"gateway_id": self.gateway_id, "open_requests": len(self.streams), "port": self.config.port}

    def phase(self) -> str:
        """serving, or what a request would wait for (the tokenizers' status and the
        engines' stats tell; /health asks a tokenizer itself)."""
        missing = [] if self.fleet.live("tokenizer") else ["a tokenizer"]
        if not self.engine_stats.ready_engines(self.config.engine_ready_ttl):
            missing.append("a ready engine")
        return "waiting for " + " and ".join(missing) if missing else "serving"

    async def setup(self) -> None:
        await self.subscribe(STREAM_CHANNEL.subject(self.gateway_id), self._on_deltas)
        await self.subscribe(ENGINE_STATS_CHANNEL.subject(), self._on_stats)
        await self.subscribe(SERVICE_RESTARTS_CHANNEL.subject(), self._on_restarts)
        await self.subscribe(SERVICE_STATUS_CHANNEL.subject("*"), self._on_status)
        await self.subscribe(ROUTER_STATS_CHANNEL.subject(), self._on_router_stats)
        self.spawn(self._watch_engines())
        if self.lora is not None:
            await join_lora_bus(self, self.lora)
        # The server has our stream subscription before any tokenize request leaves.
        await flush_in_order(self.nc)

    # ------------------------------------------------------------------ inbound

    async def _on_deltas(self, msg: Msg) -> None:
        batch = STREAM_CHANNEL.decode(msg.data)
        for delta in batch.deltas:
            stream = self.streams.get(delta.request_id)
            if stream is None:
                self.num_dropped_deltas += 1
                logger.debug("%s: delta for an unknown or finished request dropped", delta.request_id)
                continue
            if delta.engine_id:  # P/D: handed to a decode engine, which the gateway watches now
                stream.engine_id, stream.incarnation = delta.engine_id, delta.incarnation
            stream.push(delta)
            if stream.finished:
                self.release(stream)

    async def _on_stats(self, msg: Msg) -> None:
        try:
            stats = ENGINE_STATS_CHANNEL.decode(msg.data)
        except msgspec.DecodeError as e:
            logger.warning("malformed engine stats message: %s", e)
            return
        self.engine_stats.update(stats)
        if stats.incarnation:
            self._engine_lost(stats.engine_id, "restarted", lambda s: s.incarnation != stats.incarnation)

    async def _on_status(self, msg: Msg) -> None:
        try:
            self.fleet.update(SERVICE_STATUS_CHANNEL.decode(msg.data))
        except msgspec.DecodeError as e:
            logger.warning("malformed service status on %s: %s", msg.subject, e)
    async def _on_router_stats(self, msg: Msg) -> None:
        self.router_stats.update(ROUTER_STATS_CHANNEL.decode(msg.data))

    async def _on_restarts(self, msg: Msg) -> None:
        self.metrics.service_restarts = dict(SERVICE_RESTARTS_CHANNEL.decode(msg.data).counts)

    # ------------------------------------------------------------------ lost engines

    def _engine_lost(self, engine_id: str, why: str, which) -> None:
        """Every open request that ``engine_id`` holds and ``which`` picks resumes on another
        engine (``resume.py``); one that cannot ends with 503 ``engine_lost`` (and is aborted)."""
        lost = [s for s in self.streams.values()
                if s.engine_id == engine_id and s.incarnation and not s.finished and which(s)]
        if not lost:
            return
        resumable = [s for s in lost if self.resumer.can_resume(s)]
        logger.warning("engine %s %s: resuming %d of its %d open request(s) elsewhere", engine_id, why,
                       len(resumable), len(lost))
        error = engine_lost(engine_id, why).info
        for stream in lost:
            if stream in resumable:
                self.resumer.resume(stream, engine_id, why)
            else:
                stream.fail(error)

    async def _watch_engines(self) -> None:
        """A scheduler sends EngineStats every second: one silent for longer than
        ``engine_heartbeat_timeout`` has died, and its requests would never end. A stream
        whose deltas wait behind a gap for ``GAP_TIMEOUT``, or that got none for
        ``STALL_TIMEOUT``, asks its engine to resend."""
        timeout = self.config.engine_heartbeat_timeout
        while True:
            await asyncio.sleep(min(0.5, timeout / 4))
            now = time.monotonic()
            for stream in list(self.streams.values()):
                if stream.gap_since is not None and now - stream.gap_since > GAP_TIMEOUT:
                    stream.gap_since = now  # once per GAP_TIMEOUT
                    await self._ask_resend(stream, "missing")
                elif stream.incarnation and now - max(stream.last_delta_at, stream.accepted_at) > STALL_TIMEOUT:
                    # Waiting for a place in the batch, or its last delta was lost: the
                    # engine answers only the latter (it knows the request's output).
                    stream.last_delta_at = now  # once per STALL_TIMEOUT
                    await self._ask_resend(stream, "stalled")
            for engine_id in {s.engine_id for s in self.streams.values() if s.incarnation}:
                last = self.engine_stats.last_seen(engine_id)

                def silent(s, last=last):
                    return now - max(last, s.accepted_at) > timeout

                self._engine_lost(engine_id, f"sent no heartbeat for {timeout:g}s", silent)

    # ------------------------------------------------------------------ outbound

    async def tokenize(self, streams: list[RequestStream], request: TokenizeRequest,
                       headers: dict[str, str] | None = None) -> TokenizeReply:
        """Register the prompt's ``streams`` (outputs may beat the reply here), then ask a
        tokenizer (with ``headers``: a traced request's context); the streams whose samples
        were queued learn their engine.

        Raises ``ApiError`` when the prompt reached no scheduler: the tokenizer's refusal
        as is, 503 when none is subscribed; or when it may have (``maybe_submitted``): 504
        when none answers in time. A sample the scheduler refused is in the reply's
        ``choices``. The caller releases the streams.
        """
        if self.closing:
            raise shutting_down()
        for stream in streams:
            self.streams[stream.request_id] = stream
            stream.trace_headers = headers
        name = request.request_ids[0]
        try:
            reply, request = await self._ask_tokenizer(streams, request, headers)
        except NoRespondersError:
            logger.warning("%s: no tokenizer is subscribed to %s", name, TOKENIZE)
            raise no_tokenizer() from None
        except MaxPayloadError:
            raise ApiError(
                f"the request is too large to pass on (over {self.nc.max_payload} bytes once encoded)",
                param="prompt" if request.messages is None else "messages",
                code="request_too_large",
            ) from None
        except (NatsTimeoutError, asyncio.TimeoutError):
            logger.warning("%s: no tokenizer answer within %.1fs", name, self.config.tokenize_timeout)
            raise tokenizer_timeout(self.config.tokenize_timeout) from None
        except NatsError as e:
            logger.warning("%s: tokenize request failed: %r", name, e)
            raise bus_unavailable(repr(e)) from None
        if reply.error is not None:
            raise ApiError.from_info(reply.error)
        if [c.request_id for c in reply.choices] != request.request_ids:
            error = ApiError(f"the tokenizer answered for {len(reply.choices)} of {len(streams)} samples",
                             status=502, type="internal_error")
            error.maybe_submitted = True
            raise error
        now = time.monotonic()
        for stream, choice in zip(streams, reply.choices):
            if choice.error is None:
                stream.engine_id, stream.incarnation = choice.engine_id, choice.incarnation
                stream.accepted_at = now
        return reply

    async def _ask_tokenizer(self, streams: list[RequestStream], request: TokenizeRequest,
                             headers: dict[str, str] | None = None) -> tuple[TokenizeReply, TokenizeRequest]:
        """The tokenizer's answer, and the request it answers (``headers``: a traced
        request's context). One retry after a timeout:
        the replica that took the request may have died (its queue-group place is gone, so
        the retry reaches another), or only its answer was lost and the samples are queued
        somewhere: the retry goes under new request ids and the old ones are aborted, so no
        sample runs twice (on two engines, two samples would interleave in one stream). No
        responder is asked again for a moment (``shared.bus.NO_RESPONDERS_WINDOW``)."""
        for attempt in range(TOKENIZE_ATTEMPTS):
            try:
                reply = await self.request(TOKENIZE_CHANNEL, request, timeout=self.config.tokenize_timeout,
                                           no_responders_window=NO_RESPONDERS_WINDOW, headers=headers)
                return reply, request
            except (NatsTimeoutError, asyncio.TimeoutError):
                if attempt + 1 == TOKENIZE_ATTEMPTS or self.closing:
                    raise
            logger.warning("%s: no tokenizer answer within %.1fs; trying again under new ids", request.request_ids[0],
                           self.config.tokenize_timeout)
            for stream in streams:
                old_id = stream.request_id
                stream.next_attempt()
                self.rekey(stream, old_id)
            request = msgspec.structs.replace(request, request_ids=[s.request_id for s in streams])

    async def _ask_resend(self, stream: RequestStream, why: str) -> None:
        log = logger.warning if why == "missing" else logger.debug
        log("%s: output from token %d %s; asking the engine to send it again", stream.request_id,
            stream.next_offset, why)
        self.num_resends += 1
        try:
            await self.publish(RESEND_CHANNEL, ResendOutputs(stream.request_id, stream.next_offset), self.gateway_id)
        except NatsError as e:
            logger.warning("%s: resend request not sent: %r", stream.request_id, e)

    def waits_for_an_engine(self, stream: RequestStream, choice: EngineRequestReply) -> bool:
        """A sample no engine could take (503: none ready, or none subscribed) while an
        engine was ready lately (one is restarting, say): it is placed as a resumed request
        with no tokens yet, tried again until ``engine_resume_timeout``. Whether it is."""
        if choice.error.status != 503 or not self.engine_stats.ready_engines(ENGINE_STATS_TTL) \
                or not self.resumer.can_resume(stream):
            return False
        self.resumer.resume(stream, choice.engine_id or "(any)", f"could not take it ({choice.error.message})")
        return True

    def rekey(self, stream: RequestStream, old_id: str) -> None:
        """``stream`` moved from ``old_id`` to a new engine request id (a resume): outputs
        under the old one are dropped from now on, and the old one is aborted."""
        if self.streams.get(old_id) is stream:
            del self.streams[old_id]
        self.streams[stream.request_id] = stream
        self.abort_soon([old_id])

    def release(self, stream: RequestStream) -> None:
        if self.streams.get(stream.request_id) is stream:
            del self.streams[stream.request_id]

    async def abort(self, request_ids: list[str]) -> None:
        if not request_ids or self.nc is None or self.nc.is_closed:
            return
        logger.info("aborting %s", ", ".join(request_ids))
        try:
            await self.publish(ABORT_CHANNEL, AbortRequest(request_ids=request_ids), self.gateway_id)
        except NatsError as e:
            logger.warning("abort of %s not sent: %r", request_ids, e)

    def abort_soon(self, request_ids: list[str]) -> None:
        """``abort`` from code that must not await (cleanup of a cancelled request)."""
        if request_ids:
            self.spawn(self.abort(request_ids))

    async def tokenizer_alive(self) -> bool:
        try:
            # Any answer will do: only that one comes.
            await self.nc.request(PING_CHANNEL.subject("tokenizer"), b"", timeout=self.config.health_timeout)
            return True
        except (NatsError, asyncio.TimeoutError):
            return False

    # ------------------------------------------------------------------ shutdown

    async def shutdown_requests(self) -> None:
        """End every open request (503 / an error event) and abort it in the engine."""
        self.closing = True
        streams = list(self.streams.values())
        self.streams.clear()
        error = shutting_down().info
        for stream in streams:
            stream.fail(error)
        await self.abort([s.request_id for s in streams])
        if self.nc is not None and not self.nc.is_closed:
            try:
                await self.nc.flush(timeout=1)
            except (NatsError, asyncio.TimeoutError):
                pass
