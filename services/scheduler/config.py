"""The scheduler service's own settings (the engine's are in ``shared/config.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import setting


@dataclass(frozen=True)
class SchedulerServiceConfig:
    step_timeout: float = setting(60.0, "seconds to wait for a step's result")
    stats_interval: float = setting(1.0, "seconds between EngineStats messages")
    worker_timeout: float = setting(5.0, "seconds of worker silence that fail the engine")
    max_waiting_requests: int = setting(
        1024, "requests that may wait for a place in the batch; more are refused with 429 (Retry-After)")
