"""vLLM's ``--stream-interval``: a streamed choice's tokens sent in chunks of N.

With interval 1 (the default, vLLM's) every delta the detokenizers publish (a step's
tokens of one request) becomes one SSE chunk as soon as it comes: the smoothest stream.
With N > 1 a choice's deltas are held back until N tokens wait since its last chunk,
then sent as one chunk (their text joined, logprobs in order): fewer chunks for the
gateway to encode and for the client to parse, per token, at the price of a coarser
stream. A choice's first tokens and its end (a finish reason) are always sent at once,
with whatever waits before them. A request may raise the interval (vLLM's request field
``stream_interval``), never lower it below the server's.
"""

from __future__ import annotations

from shared.protocol import FinishReason, StreamDelta


def merged(deltas: list[StreamDelta]) -> StreamDelta:
    """Consecutive deltas of one choice, in offset order, as one delta."""
    if len(deltas) == 1:
        return deltas[0]
    first, last = deltas[0], deltas[-1]
    return StreamDelta(
        request_id=last.request_id,
        token_offset=first.token_offset,
        num_tokens=sum(d.num_tokens for d in deltas),
        text="".join(d.text for d in deltas),
        finish_reason=last.finish_reason,
        num_prompt_tokens=max(d.num_prompt_tokens for d in deltas),
        num_cached_tokens=max(d.num_cached_tokens for d in deltas),
        logprobs=[lp for d in deltas for lp in d.logprobs],
        error=last.error,
        stop_reason=last.stop_reason,
        prompt_logprobs=[lp for d in deltas for lp in d.prompt_logprobs],
        engine_id=last.engine_id,
        incarnation=last.incarnation,
        token_ids=[t for d in deltas for t in d.token_ids],
    )


class ChunkInterval:
    """Per choice of one streamed request: which deltas go out now, joined."""

    def __init__(self, interval: int) -> None:
        if interval < 1:
            raise ValueError(f"stream interval must be >= 1, got {interval}")
        self.interval = interval
        self._waiting: dict[int, list[StreamDelta]] = {}
        self._sent: dict[int, int] = {}  # per choice: tokens sent so far

    def add(self, index: int, delta: StreamDelta) -> StreamDelta | None:
        """Choice ``index``'s next in-order delta; the delta to send now (it and those
        held before it, joined), or None while it waits."""
        if self.interval == 1:
            return delta
        waiting = self._waiting.setdefault(index, [])
        waiting.append(delta)
        tokens = sum(d.num_tokens for d in waiting)
        if (delta.finish_reason == FinishReason.NONE and self._sent.get(index, 0) > 0
                and tokens < self.interval):
            return None
        del self._waiting[index]
        self._sent[index] = self._sent.get(index, 0) + tokens
        return merged(waiting)

    def flush(self) -> list[tuple[int, StreamDelta]]:
        """Every choice's held deltas (joined), to send before the stream ends otherwise."""
        out = [(index, merged(waiting)) for index, waiting in self._waiting.items()]
        self._waiting.clear()
        return out
