"""Which worker ranks of an engine have joined, and whether they are still alive.

Each rank announces itself with a ``WorkerReady`` message, and repeats it as its
heartbeat. The engine may run once every rank has joined; its KV cache is the
smallest any rank reported. A member silent for longer than the timeout, or one that
comes back as a new instance (its cached request state is gone), fails the engine,
which retires the group: under tensor parallelism the ranks' process group is broken
then, so the old instances never rejoin and only a whole new set of ranks will do.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass

from shared.protocol import KVOffloadWorkerInfo, WorkerReady


@dataclass
class WorkerRecord:
    """A rank that joined: what it reported, and when it was last heard from."""

    rank: int
    instance_id: str
    num_blocks: int
    max_model_len: int
    last_seen: float
    vocab_size: int = 0
    sliding_windows: tuple[int, ...] = (0,)
    kv_offload: KVOffloadWorkerInfo | None = None


class Arrival(enum.Enum):
    """What a ready message means to the group."""

    # A member's heartbeat, or a retired instance's: nothing changes.
    HEARTBEAT = "heartbeat"
    # A rank that is not a member yet.
    NEW = "new"
    # A member rank, as another instance than the one that joined.
    RESTARTED = "restarted"


class WorkerGroup:
    """The ranks of one engine that announced themselves, by rank."""

    def __init__(
        self,
        world_size: int,
        block_size: int,
        timeout: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.world_size = world_size
        self.block_size = block_size
        self.timeout = timeout
        self._clock = clock
        self.members: dict[int, WorkerRecord] = {}
        self._retired: set[str] = set()

    def fits(self, ready: WorkerReady) -> bool:
        """Whether the rank was started for this engine's world size and block size."""
        return ready.world_size == self.world_size and ready.block_size == self.block_size

    def announce(self, ready: WorkerReady) -> Arrival:
        """Take a member's heartbeat; a NEW or RESTARTED rank is not recorded until
        ``join``, so that the engine can fail (and retire the group) in between."""
        if ready.instance_id in self._retired:
            return Arrival.HEARTBEAT  # a survivor of a failed TP group: it exits and comes back anew
        known = self.members.get(ready.rank)
        if known is None:
            return Arrival.NEW
        if known.instance_id != ready.instance_id:
            return Arrival.RESTARTED
        known.last_seen = self._clock()
        return Arrival.HEARTBEAT

    def join(self, ready: WorkerReady) -> None:
        self.members[ready.rank] = WorkerRecord(
            rank=ready.rank,
            instance_id=ready.instance_id,
            num_blocks=ready.num_blocks,
            max_model_len=ready.max_model_len,
            vocab_size=ready.vocab_size,
            sliding_windows=tuple(ready.sliding_windows or (0,)),
            kv_offload=ready.kv_offload,
            last_seen=self._clock(),
        )

    @property
    def complete(self) -> bool:
        return len(self.members) == self.world_size

    @property
    def num_blocks(self) -> int:
        """The KV cache blocks every member has room for."""
        return min(w.num_blocks for w in self.members.values())

    @property
    def vocab_size(self) -> int:
        """The token ids every member's model knows (0: a member did not say)."""
        return min(w.vocab_size for w in self.members.values())

    @property
    def sliding_windows(self) -> tuple[int, ...]:
        """Per KV cache group, its sliding window (0: full attention); the same on every
        rank (one model)."""
        return next(iter(self.members.values())).sliding_windows

    @property
    def max_model_len(self) -> int:
        """The longest sequence every member accepts."""
        return min(w.max_model_len for w in self.members.values())

    def kv_offload_infos(self) -> list[KVOffloadWorkerInfo] | None:
        """Every member's KV tiers, by rank (None: a member has none)."""
        infos = [self.members[rank].kv_offload for rank in sorted(self.members)]
        return None if any(info is None for info in infos) else infos

    def silent_rank(self) -> int | None:
        """The first member not heard from within the timeout, if any."""
        now = self._clock()
        for rank, worker in self.members.items():
            if now - worker.last_seen > self.timeout:
                return rank
        return None

    def retire(self) -> list[str]:
        """Forget every member (the engine failed); under tensor parallelism their
        instances may not join again: returns those, to be told to exit."""
        retired = []
        if self.world_size > 1:
            retired = [w.instance_id for w in self.members.values()]
            self._retired.update(retired)
        self.members.clear()
        return retired
