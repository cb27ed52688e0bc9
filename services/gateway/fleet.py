"""The service replicas a gateway hears of on the bus, for its /dashboard.

Every service replica publishes a ``ServiceStatus`` on ``llm.status.<service>`` at each
heartbeat (``shared/bus.py``, every 2 s). The gateway keeps the latest per replica: one
silent for ``SILENT_AFTER`` seconds shows as silent (its process is stuck, dead or cut
off from the bus), and one silent for ``FORGET_AFTER`` is dropped (a replica that was
scaled down or replaced by its restart, which has a new instance id).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from shared.protocol import ServiceStatus

SILENT_AFTER = 6.0  # three heartbeats
FORGET_AFTER = 30.0
# The order services are listed in: the request's way.
SERVICE_ORDER = ("gateway", "tokenizer", "scheduler", "worker", "detokenizer")


@dataclass
class Replica:
    status: ServiceStatus
    seen: float  # monotonic


class Fleet:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._replicas: dict[tuple[str, str], Replica] = {}

    def update(self, status: ServiceStatus) -> None:
        self._replicas[(status.service, status.instance_id)] = Replica(status, self._clock())

    def replicas(self) -> list[Replica]:
        """The replicas heard from within ``FORGET_AFTER``, in ``SERVICE_ORDER``."""
        now = self._clock()
        for key in [k for k, r in self._replicas.items() if now - r.seen > FORGET_AFTER]:
            del self._replicas[key]

        def order(replica: Replica):
            s = replica.status
            rank = SERVICE_ORDER.index(s.service) if s.service in SERVICE_ORDER else len(SERVICE_ORDER)
            return rank, str(s.info.get("engine_id", "")), s.info.get("rank", 0), s.instance_id

        return sorted(self._replicas.values(), key=order)

    def live(self, service: str) -> int:
        """How many replicas of ``service`` spoke within ``SILENT_AFTER``."""
        now = self._clock()
        return sum(1 for (name, _), r in self._replicas.items() if name == service and now - r.seen <= SILENT_AFTER)

    def state(self, replica: Replica) -> str:
        """serving, silent, or what it waits for."""
        if self._clock() - replica.seen > SILENT_AFTER:
            return "silent"
        return replica.status.phase
