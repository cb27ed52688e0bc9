"""One engine request's output at the gateway, put back in token order.

Detokenizer replicas publish ``StreamDelta``s for the same request independently,
so they can arrive out of order, twice, or (for a zero-token end message) after
the tokens they follow. A ``RequestStream`` keeps the next expected token offset,
buffers deltas from the future, drops repeats, and hands in-order deltas to its
sink (the HTTP request's queue) as ``(stream, delta)``; the stream ends with the
delta that carries a finish reason, or with ``(stream, ErrorInfo)``. Deltas that wait
behind a missing one for long (``gap_since``), or no delta at all for long
(``last_delta_at``: the lost one may have been the last), mean a detokenizer may have
died with it: the gateway then asks the engine to send those outputs again.

The stream also keeps what its client received as token ids (``output_token_ids``) and
the prompt it came from (``prompt_request``, sample ``choice``): enough to resume it on
another engine when the one holding it is lost (``resume.py``). A resumed stream takes a
new engine request id (``next_attempt``), so nothing the lost engine still sends under
the old one is taken.

    offsets:   0    1    2    3    4    5
    arrived:  [0,2) .......... [3,5)+end
    written:  [0,2)                          next_offset = 2, [3,5) waits
    arrives:            [2,3) -> written, then [3,5)+end   next_offset = 5, finished
"""

from __future__ import annotations

import asyncio
import time

from shared.protocol import ErrorInfo, FinishReason, StreamDelta, TokenizeRequest


class RequestStream:
    """Per-request reorder buffer; ``push`` is called from the bus handler, never blocks."""

    __slots__ = (
        "request_id", "index", "prompt_index", "next_offset", "finished", "engine_done", "finish_reason",
        "num_prompt_tokens", "num_cached_tokens", "engine_id", "incarnation", "accepted_at", "gap_since", "last_delta_at",
        "_pending", "_sink", "first_request_id", "attempt", "num_resumes", "output_token_ids", "prompt_request",
        "choice", "trace_headers",
    )

    def __init__(self, request_id: str, index: int, prompt_index: int, sink: asyncio.Queue) -> None:
        self.request_id = request_id
        self.index = index  # the OpenAI choice index
        self.prompt_index = prompt_index
        self.next_offset = 0  # == the number of output tokens written so far
        self.finished = False  # nothing more goes to the sink
        self.engine_done = False  # the engine ended the request (else it may need an abort)
        self.finish_reason = FinishReason.NONE
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0
        # The engine holding the request (from the tokenize reply), watched by the gateway.
        self.engine_id = ""
        self.incarnation = ""
        self.accepted_at = 0.0
        # Since when deltas wait behind a missing one (its detokenizer may have died).
        self.gap_since: float | None = None
        self.last_delta_at = 0.0  # when a delta for it last arrived (monotonic)
        self._pending: dict[int, list[StreamDelta]] = {}
        self._sink = sink
        # Resuming on another engine: the id it was first sent under and the attempt
        # (its id is "<first id>.r<attempt>" after the first), resumes so far, the token
        # ids written (None once a delta came without them: it cannot be resumed), and
        # its prompt's TokenizeRequest and which of its samples it is, and (traced) the
        # W3C headers its tokenize request went with: a resume stays in the same trace.
        self.first_request_id = request_id
        self.attempt = 0
        self.num_resumes = 0
        self.output_token_ids: list[int] | None = []
        self.prompt_request: TokenizeRequest | None = None
        self.choice = 0
        self.trace_headers: dict[str, str] | None = None

    @property
    def num_output_tokens(self) -> int:
        return self.next_offset

    @property
    def num_pending(self) -> int:
        return sum(len(v) for v in self._pending.values())

    def push(self, delta: StreamDelta) -> None:
        if self.finished:
            return
        self.last_delta_at = time.monotonic()
        if delta.error:
            self.engine_done = True
            self.fail(ErrorInfo(delta.error, type="internal_error", status=500))
            return
        if delta.token_offset > self.next_offset:
            if delta.num_tokens or delta.finish_reason != FinishReason.NONE:
                self._pending.setdefault(delta.token_offset, []).append(delta)
                self._note_gap()
            return
        self._accept(delta)
        while not self.finished and self.next_offset in self._pending:
            # Token-bearing deltas first: a zero-token end at the same offset comes after them.
            for waiting in sorted(self._pending.pop(self.next_offset), key=lambda d: -d.num_tokens):
                self._accept(waiting)
        # A resent range may cover deltas that were waiting: they are repeats now.
        for offset in [o for o in self._pending if o < self.next_offset]:
            del self._pending[offset]
        self._note_gap()

    def _note_gap(self) -> None:
        if not self._pending:
            self.gap_since = None
        elif self.gap_since is None:
            self.gap_since = time.monotonic()

    def _accept(self, delta: StreamDelta) -> None:
        """``delta`` starts at or before ``next_offset``."""
        if self.finished:
            return
        if delta.token_offset < self.next_offset:
            # A repeat of tokens already written; only its end (if any, and only when it
            # covers no unwritten token) still counts.
            if delta.finish_reason != FinishReason.NONE and delta.token_offset + delta.num_tokens <= self.next_offset:
                self._emit(StreamDelta(delta.request_id, self.next_offset, 0, "", delta.finish_reason,
                                       delta.num_prompt_tokens, delta.num_cached_tokens,
                                       stop_reason=delta.stop_reason))
            return
        if delta.num_tokens == 0 and delta.finish_reason == FinishReason.NONE and not delta.text:
            return
        self._emit(delta)

    def _emit(self, delta: StreamDelta) -> None:
        self.next_offset += delta.num_tokens
        if self.output_token_ids is not None:
            if len(delta.token_ids) == delta.num_tokens:
                self.output_token_ids.extend(delta.token_ids)
            else:
                self.output_token_ids = None
        if delta.num_prompt_tokens:
            self.num_prompt_tokens = delta.num_prompt_tokens
        if delta.num_cached_tokens and not self.num_cached_tokens:  # a resumed request's engine counts anew
            self.num_cached_tokens = delta.num_cached_tokens
        if delta.finish_reason != FinishReason.NONE:
            self.finished = self.engine_done = True
            self.finish_reason = FinishReason(delta.finish_reason)
            self._pending.clear()
        self._sink.put_nowait((self, delta))

    def next_attempt(self) -> str:
        """Move to a new engine request id for a resume: deltas waiting under the old one
        are dropped (the new engine sends those tokens again). Returns the new id."""
        self.attempt += 1
        self.request_id = f"{self.first_request_id}.r{self.attempt}"
        self._pending.clear()
        self.gap_since = None
        return self.request_id

    def fail(self, error: ErrorInfo) -> None:
        """End the stream with an error (engine error, timeout, gateway shutdown); unless
        the engine ended it, the owner still has to abort it there."""
        if self.finished:
            return
        self.finished = True
        self.finish_reason = FinishReason.ERROR
        self._pending.clear()
        self._sink.put_nowait((self, error))
