"""Test-only fault injection into KV cache events (tests/e2e/test_routing_faults.py,
scripts/bench_routing.py's fault run).

Read once from the environment variable ``NATSLLM_TEST_KV_EVENT_FAULTS``, a comma-separated
list of ``name=value``; unset (always, outside those runs) means no fault:

    drop=<fraction>   a scheduler leaves this fraction of its KV event batches off the bus
                      (chosen at random; they stay in its replay ring, as a batch lost on the
                      way would), so consumers see gaps in the sequence
    seed=<int>        the random choice's seed (default 0)

A service that runs with faults logs so at start-up.
"""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass, field

ENV_VAR = "NATSLLM_TEST_KV_EVENT_FAULTS"

logger = logging.getLogger(__name__)


@dataclass
class KVEventFaults:
    drop: float = 0.0
    seed: int = 0
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    @classmethod
    def from_env(cls, environ=os.environ) -> "KVEventFaults":
        spec = environ.get(ENV_VAR, "")
        if not spec:
            return cls()
        values = dict(item.split("=", 1) for item in spec.split(",") if item)
        faults = cls(drop=float(values.get("drop", 0.0)), seed=int(values.get("seed", 0)))
        logger.warning("TEST FAULTS injected into KV cache events: %s", faults)
        return faults

    def drops_batch(self) -> bool:
        return self.drop > 0 and self._rng.random() < self.drop
