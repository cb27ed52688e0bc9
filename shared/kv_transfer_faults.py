"""Test-only fault injection for KV transfers: P/D (tests/e2e/test_pd_faults.py) and the
offloading tiers (tests/e2e/test_kv_offload_faults.py).

Read once from the environment variable ``NATSLLM_TEST_KV_FAULTS``, a comma-separated list
of ``name=value``; unset (always, outside the fault tests) means no fault:

    drop_chunks=<text>    prefill workers leave every chunk request of a request whose id
                          contains <text> unanswered (the decode side times out)
    slow_chunks=<text>    prefill workers wait SLOW_CHUNK_SECONDS before answering each chunk
                          of such a request (a transfer long enough to kill a worker in it)
    drop_release=<text>   decode schedulers never send the release of a request whose id
                          contains <text> (the prefill side frees its blocks at its hold timeout)
    drop_load_push=<text> decode workers never push the end of such a request's load to their
                          scheduler (the next step's result reports it)
    slow_offload=<text>   workers start loading such a request's blocks from the host or disk
                          tier SLOW_OFFLOAD_SECONDS late (past a short --kv-offloading-load-timeout:
                          the scheduler gives the load up and the request recomputes)

A service that runs with faults logs so at start-up.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

ENV_VAR = "NATSLLM_TEST_KV_FAULTS"
SLOW_CHUNK_SECONDS = 0.5
SLOW_OFFLOAD_SECONDS = 3.0

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVTransferFaults:
    drop_chunks: str = ""
    slow_chunks: str = ""
    drop_release: str = ""
    drop_load_push: str = ""
    slow_offload: str = ""

    @classmethod
    def from_env(cls, environ=os.environ) -> "KVTransferFaults":
        spec = environ.get(ENV_VAR, "")
        if not spec:
            return cls()
        values = dict(item.split("=", 1) for item in spec.split(",") if item)
        faults = cls(drop_chunks=values.get("drop_chunks", ""), slow_chunks=values.get("slow_chunks", ""),
                     drop_release=values.get("drop_release", ""), drop_load_push=values.get("drop_load_push", ""),
                     slow_offload=values.get("slow_offload", ""))
        logger.warning("TEST FAULTS injected into KV transfers: %s", faults)
        return faults

    def drops_chunk(self, req_id: str) -> bool:
        return bool(self.drop_chunks) and self.drop_chunks in req_id

    def chunk_delay(self, req_id: str) -> float:
        return SLOW_CHUNK_SECONDS if self.slow_chunks and self.slow_chunks in req_id else 0.0

    def drops_release(self, req_id: str) -> bool:
        return bool(self.drop_release) and self.drop_release in req_id

    def drops_load_push(self, req_id: str) -> bool:
        return bool(self.drop_load_push) and self.drop_load_push in req_id

    def offload_delay(self, req_id: str) -> float:
        return SLOW_OFFLOAD_SECONDS if self.slow_offload and self.slow_offload in req_id else 0.0
