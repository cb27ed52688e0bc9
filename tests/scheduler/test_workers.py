"""Worker membership: joining, heartbeats, a silent rank, a restarted rank, retiring.

Time is a hand-driven clock: no test sleeps.
"""

from __future__ import annotations

from services.scheduler.workers import Arrival, WorkerGroup
from shared.protocol import WorkerReady


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def ready(rank: int, instance_id: str, world_size: int = 2, num_blocks: int = 32, max_model_len: int = 256,
          block_size: int = 16) -> WorkerReady:
    return WorkerReady("e0", rank, world_size, instance_id, num_blocks, max_model_len, block_size)


def joined(group: WorkerGroup, *messages: WorkerReady) -> WorkerGroup:
    for message in messages:
        assert group.announce(message) is Arrival.NEW
        group.join(message)
    return group


def test_the_group_is_complete_once_every_rank_joined_with_the_smallest_cache():
    group = WorkerGroup(world_size=2, block_size=16, timeout=5.0)
    joined(group, ready(0, "a", num_blocks=40, max_model_len=512))
    assert not group.complete
    joined(group, ready(1, "b", num_blocks=32, max_model_len=1024))
    assert group.complete
    assert (group.num_blocks, group.max_model_len) == (32, 512)
    record = group.members[1]
    assert (record.rank, record.instance_id, record.num_blocks, record.max_model_len) == (1, "b", 32, 1024)


def test_a_member_announcing_again_is_a_heartbeat():
    group = joined(WorkerGroup(2, 16, 5.0), ready(0, "a"))
    assert group.announce(ready(0, "a")) is Arrival.HEARTBEAT
    assert list(group.members) == [0]


def test_a_rank_that_does_not_fit_the_engine_is_told_apart():
    group = WorkerGroup(world_size=2, block_size=16, timeout=5.0)
    assert group.fits(ready(0, "a"))
    assert not group.fits(ready(0, "a", world_size=1))
    assert not group.fits(ready(0, "a", block_size=32))


def test_a_rank_back_as_another_instance_is_a_restart_recorded_only_on_join():
    group = joined(WorkerGroup(2, 16, 5.0), ready(0, "a"))
    assert group.announce(ready(0, "a2")) is Arrival.RESTARTED
    assert group.members[0].instance_id == "a"
    group.join(ready(0, "a2"))
    assert group.members[0].instance_id == "a2"


def test_a_member_silent_past_the_timeout_is_found():
    clock = Clock()
    group = joined(WorkerGroup(2, 16, timeout=5.0, clock=clock), ready(0, "a"), ready(1, "b"))
    clock.now += 4.0
    group.announce(ready(0, "a"))
    clock.now += 1.5
    # Rank 1 was last heard 5.5 s ago, rank 0 1.5 s ago.
    assert group.silent_rank() == 1
    group.announce(ready(1, "b"))
    assert group.silent_rank() is None


def test_retiring_a_tp_group_keeps_its_instances_out():
    group = joined(WorkerGroup(2, 16, 5.0), ready(0, "a"), ready(1, "b"))
    group.retire()
    assert group.members == {} and not group.complete
    # The survivors keep beating until they exit: they are not members again.
    assert group.announce(ready(0, "a")) is Arrival.HEARTBEAT
    assert group.announce(ready(1, "b")) is Arrival.HEARTBEAT
    assert group.members == {}
    assert group.silent_rank() is None
    # A whole new set of ranks joins.
    joined(group, ready(0, "a2"), ready(1, "b2"))
    assert group.complete


def test_retiring_a_single_rank_lets_the_same_instance_join_again():
    group = joined(WorkerGroup(1, 16, 5.0), ready(0, "a", world_size=1))
    group.retire()
    assert group.members == {}
    joined(group, ready(0, "a", world_size=1))
    assert group.complete
