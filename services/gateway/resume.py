"""Requests of a lost engine go on elsewhere: no client sees a scheduler die.

A scheduler holds its requests' state in memory; when it dies (or goes silent) that
state is gone. What a request needs to go on lives at the gateway, which has it anyway:
the prompt as the client sent it (each stream's ``TokenizeRequest`` and which of its
``n`` samples it is) and the token ids its client received, in order
(``StreamDelta.token_ids``). So when the engine holding a request restarts (a new
incarnation in its stats) or is silent for ``--engine-heartbeat-timeout``, the gateway
sends it to a tokenizer again as a resumed sample (``TokenizeRequest.resumed``): the
tokenizer prepares the prompt again (the same ids: preparation is deterministic) and
hands an ``EngineRequest`` with those output tokens to any ready engine, however
requests are routed. That engine recomputes prompt + outputs and goes on from the
client's offset; the grammar of structured output replays the outputs on the workers,
and a seeded request's generator skips the draws of the tokens it brings.

Nothing is taken twice or lost:

* the resumed request has a new id (``<id>.r<attempt>``): outputs the lost engine (or a
  detokenizer behind it) still sends under the old id are dropped, and the old id is
  aborted everywhere (an engine that was only cut off stops it);
* each attempt that gets no clean answer (no tokenizer, a timeout: it may have been
  queued) is abandoned the same way and retried under the next id, with a growing pause,
  until ``--engine-resume-timeout``; then the stream ends with 503 ``engine_lost``, as it
  does after ``MAX_RESUMES`` losses (a request that brings every engine down);
* tokens the lost engine generated that never reached the gateway are generated again:
  greedy text is the fault-free run's, a seeded request's too (except with speculative
  decoding, whose draws depend on its drafts); an unseeded random one goes on from what
  its client saw, which stays one coherent sample.

A traced request's resume goes with the W3C headers of its first tokenize request
(``RequestStream.trace_headers``): the spans of the engine that takes it over join the
request's trace.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
from nats.errors import Error as NatsError

from shared.protocol import TOKENIZE_CHANNEL, ErrorInfo, ResumedSample

from .errors import engine_lost
from .streams import RequestStream

logger = logging.getLogger(__name__)

# A request in flight at this many engine losses fails at the next: it may be what kills them.
MAX_RESUMES = 3
# Seconds between attempts to place a resumed request (doubling): engines may be restarting.
RETRY_INITIAL = 0.2
RETRY_MAX = 2.0


class Resumer:
    """``gateway``: the ``GatewayService`` whose streams it resumes."""

    def __init__(self, gateway) -> None:
        self.gateway = gateway

    def can_resume(self, stream: RequestStream) -> bool:
        return (stream.prompt_request is not None and stream.output_token_ids is not None
                and stream.num_resumes < MAX_RESUMES)

    def resume(self, stream: RequestStream, engine_id: str, why: str) -> None:
        """Resume ``stream`` (its engine ``engine_id`` was lost, ``why``) from a task; the
        stream is not watched meanwhile (its incarnation is cleared)."""
        stream.num_resumes += 1
        stream.incarnation = ""
        self.gateway.metrics.requests_resumed.inc()
        self.gateway.spawn(self._resume(stream, engine_id, why))

    async def _resume(self, stream: RequestStream, engine_id: str, why: str) -> None:
        gateway = self.gateway
        config = gateway.config
        deadline = time.monotonic() + config.engine_resume_timeout
        pause = RETRY_INITIAL
        logger.warning("%s: engine %s %s; resuming it after %d token(s)", stream.first_request_id, engine_id, why,
                       len(stream.output_token_ids))
        while self._open(stream):
            old_id, new_id = stream.request_id, stream.next_attempt()
            gateway.rekey(stream, old_id)
            request = msgspec.structs.replace(
                stream.prompt_request, request_ids=[new_id],
                resumed=[ResumedSample(stream.choice, list(stream.output_token_ids))])
            try:
                reply = await gateway.request(TOKENIZE_CHANNEL, request, timeout=config.tokenize_timeout,
                                              headers=stream.trace_headers)
            except (NatsError, asyncio.TimeoutError) as e:
                problem = f"no tokenizer answer ({type(e).__name__})"
            else:
                error = reply.error or (reply.choices[0].error if len(reply.choices) == 1 else
                                        ErrorInfo(f"{len(reply.choices)} answers for one sample", status=502))
                if error is None:
                    choice = reply.choices[0]
                    if self._open(stream):
                        stream.engine_id, stream.incarnation = choice.engine_id, choice.incarnation
                        stream.accepted_at = time.monotonic()
                        logger.info("%s: resumed on engine %s as %s", stream.first_request_id, choice.engine_id,
                                    new_id)
                    return
                if error.status not in (429, 503):  # the request itself is refused now
                    stream.fail(error)
                    return
                problem = error.message
            left = deadline - time.monotonic()
            if left <= 0:
                logger.error("%s: no engine took it again within %gs (%s)", stream.first_request_id,
                             config.engine_resume_timeout, problem)
                stream.fail(engine_lost(engine_id, f"{why}; no engine took its request again within "
                                                   f"{config.engine_resume_timeout:g}s ({problem})").info)
                return
            logger.info("%s: not resumed yet (%s); trying again in %.1fs", stream.first_request_id, problem, pause)
            await asyncio.sleep(min(pause, left))
            pause = min(pause * 2, RETRY_MAX)

    def _open(self, stream: RequestStream) -> bool:
        """The client still waits for it (not failed, timed out or gone)."""
        return not stream.finished and self.gateway.streams.get(stream.request_id) is stream
