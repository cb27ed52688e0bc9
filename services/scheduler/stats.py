"""The engine's stats message (``EngineStats``), published about once a second.

Gateways show it in /metrics and watch each engine's readiness and incarnation with it;
routers (``services/router/``) and P/D prefill engines rank engines by it. Besides the
scheduler's own figures (queues, KV cache, prefix cache, spec decode, KV transfers,
LoRA), the service counts the prompt tokens it accepted and the tokens it generated.
"""

from __future__ import annotations

import time

from shared.protocol import EngineStats

from .scheduler import Scheduler
from .spec_decode_stats import SpecDecodeLog


class EngineCounters:
    def __init__(self, engine_id: str) -> None:
        self.engine_id = engine_id
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self._spec_log = SpecDecodeLog(engine_id)

    def message(self, ready: bool, incarnation: str, scheduler: Scheduler | None, num_requests_admitted: int = 0,
                kv_events_seq: int = 0) -> EngineStats:
        """``num_requests_admitted``: the intake's count; ``kv_events_seq``: the last KV event
        batch's sequence number (0: events off)."""
        return EngineStats(
            engine_id=self.engine_id,
            ready=ready,
            timestamp=time.time(),
            incarnation=incarnation,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            num_requests_admitted=num_requests_admitted,
            kv_events_seq=kv_events_seq,
            **(scheduler.stats() if scheduler is not None else {}),
        )

    def log(self, scheduler: Scheduler | None) -> None:
        """Log speculative decoding's acceptance now and then."""
        if scheduler is not None:
            self._spec_log.maybe_log(scheduler.spec_decode_stats)
