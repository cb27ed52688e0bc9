"""P/D disaggregation, the schedulers' side: prefilled requests handed from a prefill
engine to a decode engine (docs/ARCHITECTURE.md).

Prefill side (``HandoffSender``): a request that got its first token is offered to decode
engines in turn, each chosen by the engine's router (``services/router``, kv policy among the
engines that take hand-offs: the one whose prefix cache holds most of the prompt, weighed
against its load; ``HANDOFF_ATTEMPTS`` of them, ``HANDOFF_TIMEOUT`` seconds each) while its
blocks stay held for the decode side to pull;
its first output is published once a decode engine took it, naming the new owner. No
taker: the request is decoded here. The decode side's release frees the held blocks.

Decode side (``HandoffReceiver``): a hand-off passes the same admission check as a new
request (``intake.py``); its prompt KV is pulled when it is admitted. The workers push
the ends of loads at once, and the scheduler tells each prefill engine which held
blocks may go (fire and forget: a lost release costs the hold until its timeout).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from nats.aio.msg import Msg

from services.router.router import Router
from shared.bus import respond
from shared.kv_transfer_faults import KVTransferFaults
from shared.protocol import (
    KV_HANDOFF_CHANNEL,
    KV_LOADS_DONE_CHANNEL,
    KV_RELEASE_CHANNEL,
    KV_SERVE_CHANNEL,
    EngineOutput,
    EngineRequest,
    KVConnectorMetadata,
    KVHandoff,
    KVHandoffReply,
    KVRelease,
    KVSendSpec,
)

from .intake import Intake
from .outputs import OutputPublisher
from .recovery import WorkerRecovery
from .request import Request
from .scheduler import Scheduler

logger = logging.getLogger(__name__)

# Seconds a prefill engine waits for a decode engine to take a request, per engine tried,
# and how many it tries before decoding the request itself.
HANDOFF_TIMEOUT = 2.0
HANDOFF_ATTEMPTS = 2
LOCAL = "local"  # a hand-off no decode engine took: decoded on the prefill engine


class HandoffSender:
    """Prefill side. ``router``: chooses among the decode engines (the service feeds it their
    stats and KV events); ``settled()``: returns once that router has heard the decode engines
    (``RouterOnBus.settled``); ``wake()``: the step loop has work."""

    def __init__(self, engine_id: str, incarnation: str, recovery: WorkerRecovery, intake: Intake,
                 outputs: OutputPublisher, publish, request, spawn, wake: Callable[[], None], router: Router,
                 settled: Callable[[], Awaitable[None]]) -> None:
        self.engine_id = engine_id
        self.incarnation = incarnation
        self.router = router
        self._settled = settled
        # Requests handed to each decode engine (LOCAL: none took it): natsllm:handoffs_total.
        self.decisions: dict[str, int] = {}
        self._recovery = recovery
        self._intake = intake
        self._outputs = outputs
        self._publish = publish
        self._request = request
        self._spawn = spawn
        self._wake = wake

    def start(self, scheduler: Scheduler, outputs: list[EngineOutput]) -> list[EngineOutput]:
        """Hand the requests that got their first token to decode engines (a task); their
        outputs are published once a decode engine took them, naming it. The other
        outputs are returned."""
        handoffs = scheduler.take_handoffs()
        if not handoffs:
            return outputs
        ids = {request.request_id for request, _ in handoffs}
        held = {o.request_id: o for o in outputs if o.request_id in ids}
        serve = KVConnectorMetadata(reqs_to_send=[
            KVSendSpec(r.request_id, scheduler.kv_cache_manager.get_block_ids(r.request_id)) for r, _ in handoffs])
        self._spawn(self._hand_off(scheduler, handoffs, held, serve))
        return [o for o in outputs if o.request_id not in ids]

    async def _hand_off(self, scheduler: Scheduler, handoffs, outputs: dict[str, EngineOutput],
                        serve: KVConnectorMetadata) -> None:
        # The workers may serve the held blocks at once, not after the step now running.
        await self._publish(KV_SERVE_CHANNEL, serve, self.engine_id)
        results = await asyncio.gather(*(self._hand_off_one(request, params, outputs[request.request_id])
                                         for request, params in handoffs))
        for (request, _), taken in zip(handoffs, results):
            if scheduler is not self._recovery.scheduler:
                continue
            if taken:
                output = outputs[request.request_id]
                scheduler.remember_handoff(request, output.owner_engine_id, output.owner_incarnation)
                continue
            if self._intake.take_early_abort(request.gateway_id, request.request_id):
                scheduler.release_held([request.request_id], self.incarnation)
                continue
            logger.warning("engine %s: no decode engine took %s; decoding it here", self.engine_id,
                           request.request_id)
            self.decisions[LOCAL] = self.decisions.get(LOCAL, 0) + 1
            scheduler.decode_locally(request)
            self._wake()
        await self._outputs.publish(list(outputs.values()))

    async def _hand_off_one(self, request: Request, params, output: EngineOutput) -> bool:
        """Offer the request to the router's decode engines in turn; on acceptance its first
        output names the new owner (the gateway watches that engine from then on). A prefill
        engine just started first lets its router hear the decode engines: routing at once
        would find none, and decode the request here."""
        handoff = KVHandoff(
            request=EngineRequest(
                request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
                sampling_params=request.sampling_params, arrival_time=request.arrival_time,
                eos_token_id=request.eos_token_id, gateway_id=request.gateway_id, cache_salt=request.cache_salt,
                lora_request=request.lora_request,
            ),
            output_token_ids=request.output_token_ids,
            kv_transfer_params=params,
            num_cached_tokens=max(request.num_cached_tokens, 0),
        )
        traces = self._intake.traces
        headers = traces.headers(request.request_id) if traces is not None else None
        tried: set[str] = set()
        await self._settled()
        for _ in range(HANDOFF_ATTEMPTS):
            route = self.router.route(handoff.request, exclude=frozenset(tried))
            if route is None:
                break
            engine_id = route.engine_id
            tried.add(engine_id)
            try:
                reply = await self._request(KV_HANDOFF_CHANNEL, handoff, engine_id, timeout=HANDOFF_TIMEOUT,
                                            headers=headers)
            except Exception as e:  # no responder, timeout, a bad answer: the next engine
                logger.warning("engine %s: hand-off of %s to %s failed: %r", self.engine_id, request.request_id,
                               engine_id, e)
                continue
            self.router.answered(route, reply.admission if reply.accepted else 0)
            if reply.accepted:
                self.decisions[engine_id] = self.decisions.get(engine_id, 0) + 1
                output.owner_engine_id, output.owner_incarnation = reply.engine_id, reply.incarnation
                return True
            logger.warning("engine %s: %s refused %s: %s", self.engine_id, engine_id, request.request_id, reply.error)
        return False

    async def on_release(self, msg: Msg) -> None:
        """The decode side no longer needs these requests' blocks."""
        release = KV_RELEASE_CHANNEL.decode(msg.data)
        scheduler = self._recovery.scheduler
        if scheduler is not None and scheduler.release_held(release.request_ids, release.incarnation):
            self._wake()  # the workers must stop serving them


class HandoffReceiver:
    """Decode side. ``wake()``: the step loop has work."""

    def __init__(self, engine_id: str, incarnation: str, block_size: int, recovery: WorkerRecovery,
                 intake: Intake, publish, spawn, wake: Callable[[], None]) -> None:
        self.engine_id = engine_id
        self.incarnation = incarnation
        self.block_size = block_size
        self.kv_faults = KVTransferFaults.from_env()
        self._recovery = recovery
        self._intake = intake
        self._publish = publish
        self._spawn = spawn
        self._wake = wake

    async def on_handoff(self, msg: Msg) -> None:
        """Take a prefilled request; its prompt KV is pulled when it is admitted. A known id
        is taken as accepted (a retried hand-off)."""
        handoff = KV_HANDOFF_CHANNEL.decode(msg.data)

        def make_request() -> Request:
            request = Request.from_engine_request(handoff.request, self.block_size)
            request.append_output_tokens(handoff.output_token_ids)  # prompt logprobs went with the first
            request.kv_transfer_params = handoff.kv_transfer_params
            request.came_by_handoff = True
            request.num_cached_tokens = handoff.num_cached_tokens
            return request

        queued, error = self._intake.admit(handoff.request.request_id, handoff.request.gateway_id, make_request)
        if queued and self._intake.traces is not None:
            self._intake.traces.arrived(handoff.request, msg.headers, handed_in=True)
        message = "" if error is None else error.message
        await respond(msg, KV_HANDOFF_CHANNEL, KVHandoffReply(error is None, message, self.engine_id, self.incarnation,
                                                              self._intake.num_admitted if queued else 0))

    async def on_kv_loads_done(self, msg: Msg) -> None:
        """The workers pushed the ends of loads (no step was running there)."""
        done = KV_LOADS_DONE_CHANNEL.decode(msg.data)
        scheduler = self._recovery.scheduler
        if scheduler is None or done.incarnation != self.incarnation:
            return
        scheduler.update_from_kv_loads(done.finished, done.failed, done.kv_bytes)
        if self._intake.traces is not None:
            self._intake.traces.kv_loaded(done.finished)
        self.send_releases(scheduler)
        self._wake()

    def send_releases(self, scheduler: Scheduler) -> None:
        """Tell prefill engines which held blocks may go (fire and forget: a lost release
        costs the hold until its timeout)."""
        if scheduler.connector is None:
            return
        for (engine_id, incarnation), request_ids in scheduler.connector.take_releases().items():
            request_ids = [r for r in request_ids if not self.kv_faults.drops_release(r)]
            if request_ids:
                self._spawn(self._publish(KV_RELEASE_CHANNEL, KVRelease(request_ids, incarnation), engine_id))
