"""Stop strings, from the scheduler to every detokenizer replica.

A request's stop strings and output text settings (``RequestStopStrings``) do not travel
with its step outputs (those only flag that it has some): the scheduler tells every
detokenizer replica once, batched per step on ``llm.detokenize.stops`` before the step
that may start the request, and later the ids of such requests that ended (their
entries can go). A replica that missed them (it started later, or the broadcast was
lost) asks on ``llm.engine.<id>.stops``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from nats.aio.msg import Msg

from shared.bus import respond
from shared.protocol import (
    STOP_STRINGS_CHANNEL,
    STOP_STRINGS_QUERY_CHANNEL,
    EngineOutput,
    RequestStopStrings,
    SamplingParams,
    StopStrings,
)

from .request import Request

logger = logging.getLogger(__name__)

# Characters of stop strings per broadcast or query answer, at most (one request's may
# exceed it): a message stays far below the bus's payload limit (8 MiB).
STOP_STRINGS_MESSAGE_CHARS = 1 << 18


def stop_strings_chars(entry: RequestStopStrings) -> int:
    return sum(len(s) for s in entry.stop)


class StopStringsBroadcast:
    """What the detokenizers must hear since the last broadcast, and the answers to their
    queries. ``lookup(request_id)``: a request's entry, if this engine knows it."""

    def __init__(self, engine_id: str, publish, lookup: Callable[[str], RequestStopStrings | None]) -> None:
        self.engine_id = engine_id
        self._publish = publish
        self._lookup = lookup
        # Accepted requests' entries, and ids of requests with stop strings that ended,
        # since the last broadcast.
        self.added: list[RequestStopStrings] = []
        self.finished: list[str] = []
        self.num_queries = 0

    def accepted(self, request_id: str, params: SamplingParams) -> None:
        if params.has_text_settings:
            self.added.append(RequestStopStrings.of(request_id, params))

    def ended(self, requests: Iterable[Request]) -> None:
        self.finished.extend(r.request_id for r in requests if r.sampling_params.has_text_settings)

    def ended_outputs(self, outputs: Iterable[EngineOutput]) -> None:
        self.finished.extend(o.request_id for o in outputs if o.has_stop and o.finish_reason)

    async def send(self) -> None:
        """Tell every detokenizer replica the stop strings of the requests accepted since
        the last call (before any output of theirs can exist) and which ended; chunked,
        so that no message nears the bus's payload limit."""
        added, self.added = self.added, []
        finished, self.finished = self.finished, []
        if not added and not finished:
            return
        chunks: list[list[RequestStopStrings]] = [[]]
        chars = 0
        for entry in added:
            if chunks[-1] and chars + stop_strings_chars(entry) > STOP_STRINGS_MESSAGE_CHARS:
                chunks.append([])
                chars = 0
            chunks[-1].append(entry)
            chars += stop_strings_chars(entry)
        for i, chunk in enumerate(chunks):
            message = StopStrings(chunk, finished if i == 0 else [])
            try:
                await self._publish(STOP_STRINGS_CHANNEL, message)
            except Exception as e:  # the detokenizers ask for what they miss
                logger.warning("engine %s: stop strings broadcast not sent: %r", self.engine_id, e)

    async def on_query(self, msg: Msg) -> None:
        """A detokenizer missed the broadcast of these requests' stop strings: answer those
        this engine knows, as many as fit one message (it asks again for the rest)."""
        self.num_queries += 1
        found, chars = [], 0
        for request_id in STOP_STRINGS_QUERY_CHANNEL.decode(msg.data).request_ids:
            entry = self._lookup(request_id)
            if entry is None:
                continue
            if found and chars + stop_strings_chars(entry) > STOP_STRINGS_MESSAGE_CHARS:
                break
            chars += stop_strings_chars(entry)
            found.append(entry)
        await respond(msg, STOP_STRINGS_QUERY_CHANNEL, StopStrings(found))
