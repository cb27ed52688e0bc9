"""Intake: which requests the engine takes, and the gateways' aborts and resends.

A new request (from a tokenizer, on the scheduler queue group) and a handed-off one (P/D,
from a prefill engine) pass the same admission check, ``admit``: the engine is ready, no
more than ``max_waiting_requests`` wait, no abort overtook the request, and the scheduler
takes it (``RequestRejected``: it cannot ever run here). A known request id is taken as
queued: a retry (a tokenizer that died before it could answer, a hand-off sent again).

Aborts travel per gateway (``llm.abort.<gateway_id>``: only that gateway, and the
detokenizers for a stop string, may publish there) and end only that gateway's requests;
so do resends (``llm.resend.<gateway_id>``: a detokenizer died with some outputs). An
abort can overtake its request (the client left while it was being tokenized): unknown
ids are remembered for ``EARLY_ABORT_TTL`` seconds and refused when they arrive.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from nats.aio.msg import Msg

from shared.bus import respond
from shared.protocol import (
    ABORT_CHANNEL,
    ENGINE_REQUESTS_CHANNEL,
    RESEND_CHANNEL,
    EngineRequestReply,
    ErrorInfo,
    subject_gateway_id,
)

from .outputs import OutputPublisher
from .recovery import WorkerRecovery
from .request import Request
from .request_traces import RequestTraces
from .scheduler import RequestRejected
from .stats import EngineCounters
from .stop_strings_broadcast import StopStringsBroadcast

logger = logging.getLogger(__name__)

# Seconds an abort for a request not (yet) seen is remembered.
EARLY_ABORT_TTL = 30.0


class Intake:
    """``is_ready()``: the engine serves requests; ``wake()``: the step loop has work."""

    def __init__(self, engine_id: str, incarnation: str, block_size: int, max_waiting_requests: int,
                 hands_off: bool, recovery: WorkerRecovery, outputs: OutputPublisher,
                 stops: StopStringsBroadcast, counters: EngineCounters, is_ready: Callable[[], bool],
                 wake: Callable[[], None], traces: RequestTraces | None = None) -> None:
        self.engine_id = engine_id
        self.incarnation = incarnation
        self.block_size = block_size
        self.max_waiting_requests = max_waiting_requests
        self.hands_off = hands_off  # P/D prefill engine: its requests go on elsewhere
        self._recovery = recovery
        self._outputs = outputs
        self._stops = stops
        self._counters = counters
        self._is_ready = is_ready
        self._wake = wake
        self.traces = traces
        self.early_aborts: dict[tuple[str, str], float] = {}  # (gateway id, request id) -> when
        # Requests admitted (new and handed off): routers count what they sent until the
        # engine's stats count it (EngineStats.num_requests_admitted).
        self.num_admitted = 0

    def admit(self, request_id: str, gateway_id: str,
              make_request: Callable[[], Request]) -> tuple[bool, ErrorInfo | None]:
        """Queue the request ``make_request`` builds, or say why not: (queued now, refusal).
        A known id is neither queued again nor refused."""
        scheduler = self._recovery.scheduler
        if not self._is_ready():
            return False, ErrorInfo(f"engine {self.engine_id} is not ready (waiting for its workers)",
                                    type="service_unavailable", status=503)
        if request_id in scheduler.requests:
            logger.info("engine %s: %s is already queued (a retry)", self.engine_id, request_id)
            return False, None
        if len(scheduler.waiting) >= self.max_waiting_requests:
            return False, ErrorInfo(
                f"engine {self.engine_id} has {self.max_waiting_requests} requests waiting; try again later",
                type="rate_limit_error", code="too_many_requests", status=429,
            )
        if (gateway_id, request_id) in self.early_aborts:
            return False, ErrorInfo("the request was aborted before it arrived", type="request_aborted", status=499)
        try:
            scheduler.add_request(make_request())
        except RequestRejected as e:
            return False, ErrorInfo(str(e), param="messages")
        self.num_admitted += 1
        self._wake()
        return True, None

    async def on_request(self, msg: Msg) -> None:
        """A tokenized request (from the queue group, or placed on this engine by a router):
        queued, or why not (the answer names this engine)."""
        request = ENGINE_REQUESTS_CHANNEL.decode(msg.data)

        def make_request() -> Request:
            new_request = Request.from_engine_request(request, self.block_size)
            new_request.do_remote_decode = self.hands_off
            return new_request

        queued, error = self.admit(request.request_id, request.gateway_id, make_request)
        if queued:
            self._stops.accepted(request.request_id, request.sampling_params)
            self._counters.prompt_tokens_total += len(request.prompt_token_ids)
            if self.traces is not None:
                self.traces.arrived(request, msg.headers)
        reply = EngineRequestReply(request.request_id, error, engine_id=self.engine_id, incarnation=self.incarnation,
                                   admission=self.num_admitted if queued else 0)
        await respond(msg, ENGINE_REQUESTS_CHANNEL, reply)

    async def on_abort(self, msg: Msg) -> None:
        # The subject names the gateway: ids of another gateway's requests are ignored.
        gateway_id = subject_gateway_id(msg.subject)
        request_ids = ABORT_CHANNEL.decode(msg.data).request_ids
        self._stops.ended(self._recovery.forget_resumable(gateway_id, request_ids))
        scheduler = self._recovery.scheduler
        if scheduler is None:
            return
        known = {req_id: scheduler.requests.get(req_id) for req_id in request_ids}
        owned = [req_id for req_id, request in known.items() if request is not None and request.gateway_id == gateway_id]
        if len(owned) < sum(r is not None for r in known.values()):
            logger.warning("engine %s: abort from gateway %s for another gateway's request ignored",
                           self.engine_id, gateway_id)
        aborted = scheduler.abort_requests(owned)
        self._stops.ended(aborted)
        if aborted:
            self._wake()  # the workers must drop their state
        now = time.monotonic()
        for req_id, request in known.items():
            if request is None:
                self.early_aborts[(gateway_id, req_id)] = now
        self.early_aborts = {k: t for k, t in self.early_aborts.items() if now - t < EARLY_ABORT_TTL}

    def take_early_abort(self, gateway_id: str, request_id: str) -> bool:
        """Whether an abort of this request came before this engine knew it (forgotten now)."""
        return self.early_aborts.pop((gateway_id, request_id), None) is not None

    async def on_resend(self, msg: Msg) -> None:
        gateway_id = subject_gateway_id(msg.subject)
        resend = RESEND_CHANNEL.decode(msg.data)
        scheduler = self._recovery.scheduler
        output = None if scheduler is None else scheduler.resend_output(resend.request_id, resend.token_offset)
        if output is not None and output.gateway_id != gateway_id:
            logger.warning("engine %s: resend of %s asked by gateway %s, not its own, ignored", self.engine_id,
                           resend.request_id, gateway_id)
            return
        if output is not None:
            logger.info("engine %s: %s: outputs from token %d sent again", self.engine_id, resend.request_id,
                        resend.token_offset)
            await self._outputs.publish([output])
