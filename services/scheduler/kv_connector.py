"""The KV connector's scheduler role (P/D disaggregation; vLLM's ``KVConnector`` scheduler side).

The scheduler learns only "N prompt tokens are available remotely", allocates, and waits;
this module keeps the rest: which requests are held for a decode engine, which are being
loaded, their deadlines, and the per-step ``KVConnectorMetadata`` that tells the workers'
connector role (``services/worker/kv_transfer/``) what to serve, load, stop or cancel.

Prefill side (``kv_producer``): a request runs its prompt and samples one token, then
``request_finished`` holds its blocks (the workers serve them) and returns the
``KVTransferParams`` the decode engine needs. The hold ends with ``release`` (the decode
side has the KV, gave up, or the request ended) or at its deadline (a lost release):
nothing is held forever.

Decode side (``kv_consumer`` / ``kv_both``): a handed-off request arrives with its params.
When admitted, ``get_num_new_matched_tokens`` says how many prompt tokens past the local
prefix-cache hits lie remotely (cached blocks are not transferred), the scheduler allocates
blocks for them (not cached until loaded) and parks the request in
``WAITING_FOR_REMOTE_KVS``; ``update_state_after_alloc`` queues the load for the workers.
Rank 0 reports loads finished or failed (``ModelRunnerOutput``); a failure, a deadline
passed, or a remote engine of another shape makes the request recompute its prompt
locally. Every end of a load queues a release for the prefill engine (``take_releases``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from shared.config import KVTransferConfig
from shared.protocol import KVConnectorMetadata, KVRecvSpec, KVSendSpec, KVTransferParams

from .request import Request

logger = logging.getLogger(__name__)


@dataclass
class HeldRequest:
    """Prefill side: a handed-off request whose blocks stay allocated until ``deadline``."""

    request: Request
    deadline: float


@dataclass
class RemoteLoad:
    """Decode side: a request whose prompt KV past ``num_local`` tokens is being pulled."""

    request: Request
    num_local: int
    num_external: int
    started: float
    deadline: float


@dataclass
class KVTransferStats:
    """Decode side counters (``EngineStats``' kv_transfer_* fields)."""

    bytes: int = 0
    seconds: float = 0.0
    requests: int = 0
    failures: int = 0
    fallbacks: int = 0


class KVConnectorScheduler:
    def __init__(
        self,
        config: KVTransferConfig,
        engine_id: str,
        incarnation: str,
        block_size: int,
        world_size: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.engine_id = engine_id
        self.incarnation = incarnation
        self.block_size = block_size
        self.world_size = world_size
        self._clock = clock
        self.holds: dict[str, HeldRequest] = {}
        self.loads: dict[str, RemoteLoad] = {}
        self._meta = KVConnectorMetadata()
        # (prefill engine id, its incarnation, request id) to tell it the blocks may go.
        self._releases: list[tuple[str, str, str]] = []
        self.stats = KVTransferStats()

    @property
    def num_waiting_for_remote_kv(self) -> int:
        return len(self.loads)

    # ------------------------------------------------------------------ both sides

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, KVTransferParams | None]:
        """The request leaves the scheduler. Returns whether its blocks stay held (a
        request handed to a decode engine: it has no finish reason yet) and, if so, where
        the decode side finds them. A load still running is cancelled and released."""
        self._end_load(request, failed=False, cancel=True)
        self._drop_params(request)
        if not request.do_remote_decode or request.finish_reason:
            return False, None
        self.holds[request.request_id] = HeldRequest(request, self._clock() + self.config.kv_hold_timeout)
        self._meta.reqs_to_send.append(KVSendSpec(request.request_id, list(block_ids)))
        return True, KVTransferParams(
            remote_engine_id=self.engine_id,
            remote_incarnation=self.incarnation,
            num_remote_tokens=request.num_prompt_tokens,
            num_remote_blocks=len(block_ids),
            remote_world_size=self.world_size,
            remote_block_size=self.block_size,
        )

    def build_connector_meta(self) -> KVConnectorMetadata | None:
        """What the workers must do before the next step (None: nothing); resets it."""
        meta, self._meta = self._meta, KVConnectorMetadata()
        return None if meta.is_empty() else meta

    # ------------------------------------------------------------------ prefill side

    def release(self, request_ids: list[str], incarnation: str) -> list[Request]:
        """The decode side is done with these holds: the requests whose blocks to free now
        (unknown ids, or of another incarnation of this scheduler, are ignored)."""
        if incarnation != self.incarnation:
            return []
        return [self._end_hold(req_id) for req_id in request_ids if req_id in self.holds]

    def expired_holds(self) -> list[Request]:
        """Holds whose release never came: their blocks go now."""
        now = self._clock()
        expired = [req_id for req_id, held in self.holds.items() if held.deadline <= now]
        for req_id in expired:
            logger.warning("%s: no release within %gs; freeing its held KV blocks", req_id, self.config.kv_hold_timeout)
        return [self._end_hold(req_id) for req_id in expired]

    def _end_hold(self, req_id: str) -> Request:
        self._meta.reqs_not_to_send.append(req_id)
        return self.holds.pop(req_id).request

    # ------------------------------------------------------------------ decode side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """vLLM's: how many tokens past the ``num_computed_tokens`` local hits the remote
        side holds, and whether they load asynchronously (always, here). 0 when the
        request has nothing to load: it then computes its prompt as any other."""
        params = request.kv_transfer_params
        if params is None:
            return 0, False
        if (params.remote_world_size, params.remote_block_size) != (self.world_size, self.block_size):
            # Each rank pulls the same rank's shard: another TP size or block size cannot.
            logger.warning("%s: remote engine %s has TP %d / block size %d, this one %d / %d; recomputing",
                           request.request_id, params.remote_engine_id, params.remote_world_size,
                           params.remote_block_size, self.world_size, self.block_size)
            self.stats.fallbacks += 1
            self._drop_params(request)
            return 0, False
        num_external = params.num_remote_tokens - num_computed_tokens
        if num_external <= 0:
            self._drop_params(request)  # all in the local prefix cache
            return 0, False
        return num_external, True

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_local: int,
                                 num_external: int) -> None:
        """The request holds ``block_ids`` for its first ``num_local + num_external`` tokens:
        the workers fill those past the local hits from the remote blocks."""
        params = request.kv_transfer_params
        first_block = num_local // self.block_size
        now = self._clock()
        self.loads[request.request_id] = RemoteLoad(request, num_local, num_external, now,
                                                    now + self.config.kv_transfer_timeout)
        self._meta.reqs_to_recv.append(KVRecvSpec(request.request_id, block_ids[first_block:], first_block,
                                                  params.remote_engine_id, params.remote_incarnation))

    def finished_loading(self, request_ids: list[str]) -> list[RemoteLoad]:
        """Loads the workers completed: the requests may run from their loaded tokens."""
        loads = [self.loads.get(req_id) for req_id in request_ids]
        loads = [load for load in loads if load is not None]
        now = self._clock()
        for load in loads:
            self.stats.requests += 1
            self.stats.seconds += now - load.started
            self._end_load(load.request, failed=False, cancel=False)
            self._drop_params(load.request)
        return loads

    def failed_loading(self, request_ids: list[str]) -> list[Request]:
        """Loads a worker gave up (and cancelled itself): those requests recompute."""
        loads = [self.loads[req_id] for req_id in request_ids if req_id in self.loads]
        for load in loads:
            logger.warning("%s: loading its prompt KV from %s failed; recomputing", load.request.request_id,
                           load.request.kv_transfer_params.remote_engine_id)
            self._end_load(load.request, failed=True, cancel=True)
        return [load.request for load in loads]

    def expired_loads(self) -> list[Request]:
        """Loads past their deadline: cancelled at the workers; those requests recompute."""
        now = self._clock()
        expired = [load for load in self.loads.values() if load.deadline <= now]
        for load in expired:
            logger.warning("%s: its prompt KV did not arrive within %gs; recomputing", load.request.request_id,
                           self.config.kv_transfer_timeout)
            self._end_load(load.request, failed=True, cancel=True)
        return [load.request for load in expired]

    def _end_load(self, request: Request, failed: bool, cancel: bool) -> None:
        load = self.loads.pop(request.request_id, None)
        if load is None:
            return
        if cancel:
            self._meta.reqs_to_cancel.append(request.request_id)
        if failed:
            self.stats.failures += 1
            self.stats.fallbacks += 1
            self._drop_params(request)

    def _drop_params(self, request: Request) -> None:
        """The request no longer needs the remote blocks: the prefill side may free them."""
        params, request.kv_transfer_params = request.kv_transfer_params, None
        if params is not None:
            self._releases.append((params.remote_engine_id, params.remote_incarnation, request.request_id))

    def take_releases(self) -> dict[tuple[str, str], list[str]]:
        """Releases to send, by (prefill engine id, its incarnation)."""
        grouped: dict[tuple[str, str], list[str]] = {}
        for engine_id, incarnation, req_id in self._releases:
            grouped.setdefault((engine_id, incarnation), []).append(req_id)
        self._releases.clear()
        return grouped
