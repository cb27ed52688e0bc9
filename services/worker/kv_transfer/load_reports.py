"""The ends of KV loads, gathered on rank 0 and told to the scheduler (both KV connectors').

A load (a P/D pull, or the offloading connector's load from the host or disk tier) is done
when every rank has written its shard into its blocks. Ranks > 0 tell rank 0 the ends of
theirs (``KVRecvDone`` on ``llm.engine.<id>.kv.recvd``); rank 0 reports a load finished
once every rank finished it, failed once any rank failed it.

Rank 0 reports the ends in the next step's result, or, when they come while no step runs
on it, pushes them to the scheduler at once (``KVLoadsDone`` on ``llm.engine.<id>.kv.loaded``):
an engine with nothing else to run sends no steps only to learn of them. The next step's
result repeats what was pushed, so a lost push costs the wait for the scheduler's next
step (its slow poll, ``KV_LOAD_POLL_INTERVAL``). Without a bus (the in-process engine),
ends are only taken with each step's result. The offloading connector's traffic counters
ride on step results only.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from nats.errors import Error as NatsError

from shared.bus import publish
from shared.kv_transfer_faults import KVTransferFaults
from shared.protocol import KV_LOADS_DONE_CHANNEL, KV_RECV_DONE_CHANNEL, KVLoadsDone, KVRecvDone

logger = logging.getLogger(__name__)


class LoadReports:
    """``service``: the worker service (bus connection and task spawner), None in-process."""

    def __init__(self, service, engine_id: str, rank: int, world_size: int,
                 faults: KVTransferFaults = KVTransferFaults()) -> None:
        self.service = service
        self.engine_id = engine_id
        self.rank = rank
        self.world_size = world_size
        self.faults = faults
        self.incarnation = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        # Threads (the connectors' copy threads) report too.
        self._lock = threading.Lock()
        # Rank 0: the ranks that finished each load, loads failed, bytes pulled (rank 0's).
        self._finished_ranks: dict[str, set[int]] = {}
        self._failed: set[str] = set()
        self._bytes = 0
        # Rank 0: whether a step runs (its result will carry the ends), and the ends pushed
        # since the last step's result (which repeats them).
        self._step_running = False
        self._pushed_finished: set[str] = set()
        self._pushed_failed: set[str] = set()

    async def setup(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self.rank == 0 and self.world_size > 1 and self.service is not None:
            await self.service.subscribe(KV_RECV_DONE_CHANNEL.subject(self.engine_id), self._on_recv_done)

    def step_started(self, incarnation: str, reset: bool) -> None:
        """A step arrived (before its forward pass); a reset one starts a new scheduler's
        incarnation, which waits for no load of the old one."""
        with self._lock:
            self._step_running = True
            if reset:
                self.incarnation = incarnation
                self._finished_ranks.clear()
                self._failed.clear()
                self._pushed_finished.clear()
                self._pushed_failed.clear()

    def add_bytes(self, num_bytes: int) -> None:
        with self._lock:
            self._bytes += num_bytes

    def take_finished(self) -> tuple[list[str], list[str], int]:
        """Rank 0, at the end of a step: loads every rank finished and loads some rank failed
        since the last step (those pushed meanwhile again), and the bytes this rank pulled
        and did not push."""
        with self._lock:
            self._step_running = False
            finished, failed, num_bytes = self._take_ended()
            finished = sorted(self._pushed_finished.union(finished))
            failed = sorted(self._pushed_failed.union(failed))
            self._pushed_finished.clear()
            self._pushed_failed.clear()
        return finished, failed, num_bytes

    def _take_ended(self) -> tuple[list[str], list[str], int]:
        """Loads ended since the last look, and the bytes pulled meanwhile (under the lock)."""
        finished = [r for r, ranks in self._finished_ranks.items() if len(ranks) == self.world_size]
        for req_id in finished:
            del self._finished_ranks[req_id]
        failed = sorted(self._failed)
        self._failed.clear()
        for req_id in failed:
            self._finished_ranks.pop(req_id, None)
        num_bytes, self._bytes = self._bytes, 0
        return finished, failed, num_bytes

    async def report(self, req_id: str, failed: bool) -> None:
        """This rank ended its share of ``req_id``'s load (on the event loop)."""
        if self.rank == 0:
            self._record(self.rank, [] if failed else [req_id], [req_id] if failed else [])
            return
        done = KVRecvDone(self.rank, [] if failed else [req_id], [req_id] if failed else [])
        try:
            await publish(self.service.nc, KV_RECV_DONE_CHANNEL, done, self.engine_id)
        except NatsError as e:  # the scheduler's deadline recomputes the prompt
            logger.warning("%s: load end not reported to rank 0: %r", req_id, e)

    def report_now(self, req_id: str, failed: bool) -> None:
        """``report`` from any thread: on the service's event loop, or at once in-process."""
        if self._loop is None:
            self._record(self.rank, [] if failed else [req_id], [req_id] if failed else [])
        else:
            self._loop.call_soon_threadsafe(lambda: self.service.spawn(self.report(req_id, failed)))

    async def _on_recv_done(self, msg) -> None:
        done = KV_RECV_DONE_CHANNEL.decode(msg.data)
        self._record(done.rank, done.finished, done.failed)

    def _record(self, rank: int, finished: list[str], failed: list[str]) -> None:
        with self._lock:
            for req_id in finished:
                if req_id not in self._failed:
                    self._finished_ranks.setdefault(req_id, set()).add(rank)
            self._failed.update(failed)
            idle = not self._step_running
        if idle and self.service is not None:
            self.service.spawn(self._push_ended())

    async def _push_ended(self) -> None:
        """Rank 0, no step running: tell the scheduler now which loads ended."""
        with self._lock:
            if self._step_running:
                return  # a step started meanwhile: its result carries them
            finished, failed, num_bytes = self._take_ended()
            if not finished and not failed:
                self._bytes += num_bytes
                return
            self._pushed_finished.update(finished)
            self._pushed_failed.update(failed)
        if any(self.faults.drops_load_push(req_id) for req_id in finished + failed):
            logger.warning("TEST FAULT: push of the ends of loads %s dropped", finished + failed)
            return  # the next step's result carries them
        done = KVLoadsDone(self.incarnation, finished, failed, num_bytes)
        try:
            await publish(self.service.nc, KV_LOADS_DONE_CHANNEL, done, self.engine_id)
        except NatsError as e:  # the next step's result repeats them
            logger.warning("engine %s: ended loads not pushed to the scheduler: %r", self.engine_id, e)
