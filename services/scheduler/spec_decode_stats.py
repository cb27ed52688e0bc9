"""Counters of speculative decoding, with vLLM's metric names.

The scheduler records each verified draft run (how many drafts a request's step
carried, how many of them the workers accepted); the counts go out in ``EngineStats``
and the gateways show them as ``<prefix>spec_decode_num_drafts`` and so on.
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)

# Seconds between two log lines of the acceptance figures.
LOG_INTERVAL = 10.0


class SpecDecodeStats:
    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # How often the draft at each position (0 = the first) was accepted.
        self.num_accepted_tokens_per_pos = [0] * num_speculative_tokens

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a step yields per draft run: the accepted drafts and the target's own."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_engine_stats(self) -> dict:
        if not self.num_accepted_tokens_per_pos:
            return {}
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
        }


class SpecDecodeLog:
    """A log line every ``LOG_INTERVAL`` seconds with the acceptance since the last one."""

    def __init__(self, engine_id: str, interval: float = LOG_INTERVAL) -> None:
        self.engine_id = engine_id
        self.interval = interval
        self._last_at = time.monotonic()
        self._last: tuple[int, int, int] = (0, 0, 0)

    def maybe_log(self, stats: SpecDecodeStats) -> None:
        now = time.monotonic()
        if now - self._last_at < self.interval:
            return
        current = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
        # A new scheduler (after an engine failure) starts its counts again.
        last = self._last if all(c >= p for c, p in zip(current, self._last)) else (0, 0, 0)
        drafts, draft_tokens, accepted = (c - p for c, p in zip(current, last))
        self._last_at, self._last = now, current
        if drafts:
            logger.info("engine %s: speculative decoding: mean acceptance length %.2f, %d of %d draft "
                        "tokens accepted (%.1f%%) in %d drafts", self.engine_id, 1 + accepted / drafts,
                        accepted, draft_tokens, 100 * accepted / draft_tokens, drafts)
