"""The KV connector's worker role (P/D; vLLM's ``KVConnector`` worker side) over NATS.

Each rank of a prefill engine serves the blocks its scheduler holds for decode engines
(``KVConnectorMetadata.reqs_to_send``) on its own subject, ``llm.engine.<id>.kv.pull.<rank>``,
until told to stop (``reqs_not_to_send``). Each rank of a decode engine pulls its shard of a
request's blocks (``reqs_to_recv``) from the same rank of the prefill engine, chunk by chunk
(``chunks.py``), and writes each chunk straight into its paged cache (``block_io.py``).

Nothing here runs on the forward thread: pulls are asyncio tasks and replies are served by
the bus handler, and the copies in and out of the cache run on one "kv-transfer" thread,
so neither engine's step loop waits for a transfer. One lock orders the copies against the
metadata each step brings (applied between steps, before the step's forward pass): once a
step has said "stop serving" or "cancel", no copy touches those blocks again, so the
scheduler may give them to other requests in that very step.

A pull that fails (no responder, a chunk timeout, a refusal, a chunk of the wrong size) or
passes its deadline is reported failed and the scheduler recomputes the prompt. A refusal
with ``retry`` (the prefill rank has not applied the step that starts serving yet) is asked
again. The ends of loads go to the scheduler through ``LoadReports`` (``load_reports.py``,
shared with the offloading connector): under TP rank 0 reports a load once every rank
ended it; a lost message makes the scheduler's deadline recompute the prompt.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

from nats.errors import Error as NatsError

from shared.config import KVTransferConfig
from shared.kv_transfer_faults import KVTransferFaults
from shared.bus import request, respond
from shared.protocol import KV_PULL_CHANNEL, KV_SERVE_CHANNEL, KVChunk, KVConnectorMetadata, KVPull, KVRecvSpec

from .block_io import KVBlockIO
from .chunks import plan_chunks
from .load_reports import LoadReports

logger = logging.getLogger(__name__)

# Chunk payloads stay this far below the bus's limit (room for the message's envelope).
PAYLOAD_MARGIN = 64 * 1024
MAX_CHUNK_BYTES = 4 << 20
RETRY_INTERVAL = 0.01
# Ids of released requests remembered, to refuse late pulls of them for good.
RELEASED_MEMORY = 4096


class KVConnectorWorker:
    def __init__(self, service, engine_id: str, rank: int, world_size: int, kv_caches,
                 config: KVTransferConfig, reports: LoadReports, faults: KVTransferFaults = KVTransferFaults()) -> None:
        """``service``: the worker service (its bus connection and task spawner); ``reports``:
        where the ends of loads go (shared with the offloading connector)."""
        self.service = service
        self.engine_id = engine_id
        self.rank = rank
        self.world_size = world_size
        self.config = config
        self.faults = faults
        self.reports = reports
        self.io = KVBlockIO(kv_caches)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-transfer")
        self._lock = threading.Lock()
        # Serving (prefill side), under the lock.
        self._incarnation = ""
        self._sending: dict[str, list[int]] = {}
        self._released: OrderedDict[str, None] = OrderedDict()
        # Loading (decode side): request id -> cancelled flag holder.
        self._loads: dict[str, dict] = {}

    async def setup(self) -> None:
        await self.service.subscribe(KV_PULL_CHANNEL.subject(self.engine_id, self.rank), self._on_pull)
        await self.service.subscribe(KV_SERVE_CHANNEL.subject(self.engine_id), self._on_serve)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ per step

    def bind_connector_metadata(self, incarnation: str, reset: bool, meta: KVConnectorMetadata | None) -> None:
        """Between steps, before the forward pass: apply what the scheduler decided (the
        worker service has told ``reports`` the step started)."""
        with self._lock:
            if reset:  # a new scheduler: nothing it did not ask for is served or loaded
                self._incarnation = incarnation
                self._forget_sends(list(self._sending))
                for flag in self._loads.values():
                    flag["cancelled"] = True
                self._loads.clear()
            if meta is None:
                return
            self._forget_sends(meta.reqs_not_to_send)
            for req_id in meta.reqs_to_cancel:
                flag = self._loads.pop(req_id, None)
                if flag is not None:
                    flag["cancelled"] = True
            self._start_serving(meta.reqs_to_send)
        for spec in meta.reqs_to_recv:
            flag = {"cancelled": False}
            self._loads[spec.req_id] = flag
            self.service.spawn(self._load(spec, flag))

    async def _on_serve(self, msg) -> None:
        """Serve held requests now, ahead of the step that says so too (the forward thread
        may be in a long prefill): only ever adds blocks that are held, never reused ones."""
        with self._lock:
            self._start_serving(KV_SERVE_CHANNEL.decode(msg.data).reqs_to_send)

    def _start_serving(self, specs) -> None:
        for spec in specs:
            if spec.req_id not in self._released:  # a late announcement of a released hold
                self._sending[spec.req_id] = spec.block_ids

    def _forget_sends(self, request_ids) -> None:
        for req_id in request_ids:
            if self._sending.pop(req_id, None) is not None:
                self._released[req_id] = None
        while len(self._released) > RELEASED_MEMORY:
            self._released.popitem(last=False)

    # ------------------------------------------------------------------ serving

    async def _on_pull(self, msg) -> None:
        pull = KV_PULL_CHANNEL.decode(msg.data)
        if self.faults.drops_chunk(pull.req_id):
            return  # test-only fault: the decode side times out
        if self.faults.chunk_delay(pull.req_id):
            await asyncio.sleep(self.faults.chunk_delay(pull.req_id))
        loop = asyncio.get_running_loop()
        chunk = await loop.run_in_executor(self._executor, self._serve, pull)
        await respond(msg, KV_PULL_CHANNEL, chunk)

    def _serve(self, pull: KVPull) -> KVChunk:
        with self._lock:
            if pull.incarnation != self._incarnation:
                return KVChunk(error=f"engine {self.engine_id} rank {self.rank} no longer holds blocks of that "
                                     f"scheduler (it restarted)")
            block_ids = self._sending.get(pull.req_id)
            if block_ids is None:
                if pull.req_id in self._released:
                    return KVChunk(error=f"{pull.req_id}'s blocks were released")
                return KVChunk(retry=True)
            ids = block_ids[pull.first_block:pull.first_block + pull.num_blocks]
            layers_ok = 0 <= pull.first_layer and pull.first_layer + pull.num_layers <= self.io.num_layers
            if pull.first_block < 0 or len(ids) != pull.num_blocks or not layers_ok:
                return KVChunk(error=f"{pull.req_id}: blocks or layers out of range")
            return KVChunk(self.io.gather(ids, pull.first_layer, pull.num_layers))

    # ------------------------------------------------------------------ loading

    async def _load(self, spec: KVRecvSpec, flag: dict) -> None:
        start = time.monotonic()
        deadline = start + self.config.kv_transfer_timeout
        try:
            error = await self._pull_all(spec, flag, deadline)
        except Exception as e:  # never a dead task: the load fails and the prompt is recomputed
            logger.exception("%s: pulling its KV failed", spec.req_id)
            error = repr(e)
        if flag["cancelled"]:
            return
        self._loads.pop(spec.req_id, None)
        if error:
            logger.warning("engine %s rank %d: %s: KV pull from %s failed: %s", self.engine_id, self.rank,
                           spec.req_id, spec.remote_engine_id, error)
        else:
            logger.debug("%s: %d blocks pulled in %.3fs", spec.req_id, len(spec.block_ids), time.monotonic() - start)
        await self.reports.report(spec.req_id, failed=bool(error))

    async def _pull_all(self, spec: KVRecvSpec, flag: dict, deadline: float) -> str:
        """Every chunk of the request's blocks into the cache; an error message, or ''."""
        nc = self.service.nc
        max_bytes = min(nc.max_payload - PAYLOAD_MARGIN, MAX_CHUNK_BYTES)
        loop = asyncio.get_running_loop()
        for chunk in plan_chunks(len(spec.block_ids), self.io.num_layers, self.io.layer_block_bytes, max_bytes):
            pull = KVPull(spec.req_id, spec.remote_incarnation, spec.first_block + chunk.first_block,
                          chunk.num_blocks, chunk.first_layer, chunk.num_layers)
            while True:
                if flag["cancelled"]:
                    return "cancelled"
                timeout = min(self.config.kv_chunk_timeout, deadline - time.monotonic())
                if timeout <= 0:
                    return f"not done within {self.config.kv_transfer_timeout:g}s"
                try:
                    reply = await request(nc, KV_PULL_CHANNEL, pull, spec.remote_engine_id, self.rank, timeout=timeout)
                except (NatsError, asyncio.TimeoutError) as e:
                    return f"chunk request failed: {e!r}"
                if not reply.retry:
                    break
                await asyncio.sleep(RETRY_INTERVAL)
            if reply.error:
                return reply.error
            expected = self.io.chunk_bytes(chunk.num_blocks, chunk.num_layers)
            if len(reply.data) != expected:
                return f"a chunk of {len(reply.data)} bytes, expected {expected} (another model or dtype there?)"
            block_ids = spec.block_ids[chunk.first_block:chunk.first_block + chunk.num_blocks]
            await loop.run_in_executor(self._executor, self._write, flag, block_ids, chunk.first_layer,
                                       chunk.num_layers, reply.data)
            if self.rank == 0:
                self.reports.add_bytes(len(reply.data))
        return ""

    def _write(self, flag: dict, block_ids: list[int], first_layer: int, num_layers: int, data: bytes) -> None:
        with self._lock:
            if not flag["cancelled"]:  # cancelled: the blocks may belong to another request now
                self.io.scatter(block_ids, first_layer, num_layers, data)
