"""The tiered KV cache in the scheduler (no workers): write-back when the device pool evicts,
lookups in the host and disk tiers after the prefix cache, what a lookup credits, swap on
preemption, loads that finish, fail or time out, and the metadata the workers get."""

from __future__ import annotations

import os
import shutil

import pytest

from services.scheduler.kv_connector import KVConnectorScheduler
from services.scheduler.kv_events import KVEventRecorder
from services.scheduler.kv_offload.connector import OffloadingConnectorScheduler
from services.scheduler.request import Request, RequestStatus
from services.scheduler.scheduler import Scheduler
from shared.config import KV_BOTH, CacheConfig, KVOffloadConfig, KVTransferConfig, SchedulerConfig
from shared.kv_unit_file import header_size, unit_path
from shared.protocol import BlockRemoved, BlockStored, KVOffloadWorkerInfo, ModelRunnerOutput, SamplingParams

BS = 4
UNIT = 2  # blocks per unit
# Per unit loads cost little next to recomputing (0.01 s a token): every hit is credited.
CHEAP = dict(recompute_seconds_per_token=0.01, host_load_seconds_per_unit=0.001, disk_load_seconds_per_unit=0.002)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


BLOCK_BYTES = 500  # the fake workers' unit_bytes (1000) over UNIT


def file_unit(folder, block_hashes, names=None):
    """A unit file as the workers file it (the right size; the scheduler only stats it)."""
    for name in names or block_hashes:
        path = unit_path(str(folder), "ns", name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(bytes(header_size(len(block_hashes)) + len(block_hashes) * BLOCK_BYTES))


def make(num_blocks=8, host_slots=16, path="", clock=None, policy="write_back", costs=CHEAP, pd=False, events=None,
         **config):
    offload_config = KVOffloadConfig(kv_offloading_size=1.0, kv_offloading_path=path,
                                     kv_offloading_block_size=UNIT * BS, kv_offloading_disk_write_policy=policy,
                                     kv_offloading_load_timeout=5.0, **config)
    info = KVOffloadWorkerInfo(host_slots, 1000, "ns" if path else "", **costs)
    offload = OffloadingConnectorScheduler(offload_config, BS, [info], clock=clock or Clock())
    connector = KVConnectorScheduler(KVTransferConfig(kv_role=KV_BOTH), "e", "inc", BS, 1) if pd else None
    return Scheduler(SchedulerConfig(async_scheduling=False, max_num_seqs=4), CacheConfig(block_size=BS), num_blocks,
                     256, kv_offload=offload, kv_connector=connector, kv_events=events)


def request(req_id, prompt, max_tokens=1):
    return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                   block_size=BS)


def answer(sched, step, finished=(), failed=()):
    tokens = []
    for req_id in step.scheduled_req_ids:
        req = sched.requests.get(req_id)
        tokens.append([5] if req is not None and req.num_computed_tokens >= req.num_tokens else [])
    return sched.update_from_output(step, ModelRunnerOutput(step.step_id, step.scheduled_req_ids, tokens,
                                                            finished_recving=list(finished),
                                                            failed_recving=list(failed)))


def run(sched, req):
    """Run one request to its end; returns every step it took."""
    sched.add_request(req)
    steps = []
    while req.request_id in sched.requests:
        step = sched.schedule()
        steps.append(step)
        answer(sched, step)
    return steps


def stores_of(steps):
    return [s for step in steps if step.kv_connector_metadata for s in step.kv_connector_metadata.offload_stores]


PROMPT_A = list(range(100, 117))  # 17 tokens: 4 full blocks + 1
PROMPT_B = list(range(200, 217))


def test_evicted_blocks_go_to_the_host_tier_as_units_and_nothing_the_device_still_holds():
    sched = make(num_blocks=6)
    steps = run(sched, request("a", PROMPT_A))
    assert stores_of(steps) == []  # nothing evicted yet: nothing copied
    steps = run(sched, request("b", PROMPT_B))  # needs 5 of the 6 blocks: A's go
    stores = stores_of(steps)
    assert stores and all(s.slot >= 0 and not s.block_hashes for s in stores)
    host = sched.offload.host
    a_hashes = request("x", PROMPT_A).block_hashes
    # A's blocks went down as whole units of 2, each from its unit's first block.
    found = [host.find(h) for h in a_hashes[:4]]
    assert all(f is not None for f in found)
    assert [offset for _, offset in found] == [0, 1, 0, 1]
    assert sum(len(s.block_ids) for s in stores) == 4  # each block copied once


def test_the_host_tier_has_kv_events_of_its_own_medium():
    events = KVEventRecorder(BS)
    sched = make(num_blocks=6, host_slots=2, events=events)  # room for one prompt's two units
    run(sched, request("a", PROMPT_A))
    run(sched, request("b", PROMPT_B))  # A's blocks go to the host tier
    run(sched, request("c", list(range(300, 317))))  # B's too: A's units leave it
    a_hashes, b_hashes = request("x", PROMPT_A).block_hashes[:4], request("y", PROMPT_B).block_hashes[:4]
    recorded = events.take()

    def on_host(kind):
        return sorted(h for e in recorded if isinstance(e, kind) and e.medium == "CPU" for h in e.block_hashes)

    assert on_host(BlockStored) == sorted(a_hashes + b_hashes)
    assert on_host(BlockRemoved) == sorted(a_hashes)
    # The device's own events are there as before.
    assert {e.medium for e in recorded if isinstance(e, BlockStored | BlockRemoved)} == {"GPU", "CPU"}


def test_a_prompt_whose_blocks_a_tier_holds_loads_them_and_counts_them_cached():
    sched = make(num_blocks=6)
    run(sched, request("a", PROMPT_A))
    run(sched, request("b", PROMPT_B))
    again = request("a2", PROMPT_A + [1, 2, 3])
    sched.add_request(again)
    step = sched.schedule()
    assert again.status == RequestStatus.WAITING_FOR_REMOTE_KVS and step.scheduled_req_ids == []
    [load] = step.kv_connector_metadata.offload_loads
    assert load.req_id == "a2"
    # A's first block is still on the device (B took the other five: A's tail first); its
    # other three full blocks are in the host tier, the second at offset 1 of its unit.
    assert [(len(seg.block_ids), seg.offset) for seg in load.segments] == [(1, 1), (2, 0)]
    assert all(seg.slot >= 0 for seg in load.segments)
    assert sched.kv_cache_manager.get_block_ids("a2")[1:4] == [b for seg in load.segments for b in seg.block_ids]
    units = {seg.slot for seg in load.segments}
    assert all(u.pins for u in sched.offload.host.units.values() if u.slot in units)  # not evicted while loading
    answer(sched, sched.schedule(), finished=["a2"])
    step = sched.schedule()
    assert step.scheduled_req_ids == ["a2"] and step.num_scheduled_tokens == [4]  # only what no tier held
    outputs = answer(sched, step)
    assert outputs[0].num_cached_tokens == 16
    stats = sched.stats()
    assert stats["prompt_tokens_local_cache_hit"] == 4
    assert stats["prompt_tokens_external_kv_transfer"] == 12
    assert stats["external_prefix_cache_hits"] == 12
    assert stats["kv_offload_block_hits"]["CPU"] == 3
    assert not any(u.pins for u in sched.offload.host.units.values())


def test_a_hit_is_credited_only_where_loading_beats_recomputing(tmp_path):
    costly_disk = dict(CHEAP, disk_load_seconds_per_unit=10.0)
    sched = make(num_blocks=6, host_slots=0, path=str(tmp_path), costs=costly_disk)
    run(sched, request("a", PROMPT_A))
    stores = stores_of(run(sched, request("b", PROMPT_B)))
    assert stores and all(s.slot < 0 and s.block_hashes for s in stores)  # no host tier: straight to disk
    for store in stores:  # as the workers would
        file_unit(tmp_path, store.block_hashes)
    again = request("a2", PROMPT_A)
    sched.add_request(again)
    step = sched.schedule()
    assert again.status == RequestStatus.RUNNING and not step.kv_connector_metadata.offload_loads  # recomputed
    assert sched.stats()["kv_offload_block_hits"]["DISK"] == 3  # found (block 0 is on the device), not credited
    assert sched.stats()["external_prefix_cache_hits"] == 0


def test_disk_hits_name_the_longest_unit_file_holding_each_block(tmp_path):
    sched = make(num_blocks=16, host_slots=0, path=str(tmp_path))
    hashes = request("x", PROMPT_A).block_hashes
    file_unit(tmp_path, hashes[0:2])  # a whole unit [0, 1], under both its blocks' names
    # Unit [2, 3] of another chain that shares block 2: only block 2 is ours (its name).
    other = request("y", PROMPT_A[:12] + [1, 2, 3, 4]).block_hashes
    file_unit(tmp_path, other[2:4])
    sched.add_request(request("a", PROMPT_A))
    [load] = sched.schedule().kv_connector_metadata.offload_loads
    assert [(seg.disk_key, seg.offset, seg.unit_blocks, len(seg.block_ids)) for seg in load.segments] == [
        (hashes[1], 0, 2, 2), (hashes[2], 0, 2, 1)]


def test_a_failed_load_recomputes_and_is_not_looked_up_again():
    sched = make(num_blocks=6)
    run(sched, request("a", PROMPT_A))
    run(sched, request("b", PROMPT_B))
    again = request("a2", PROMPT_A)
    sched.add_request(again)
    sched.schedule()
    step = sched.schedule()
    answer(sched, step, failed=["a2"])
    assert again.status == RequestStatus.WAITING and again.num_computed_tokens == 0
    step = sched.schedule()
    assert step.scheduled_req_ids == ["a2"] and step.num_scheduled_tokens == [13]  # all but the device's block
    assert sched.stats()["kv_offload_load_failures"] == 1
    assert not any(u.pins for u in sched.offload.host.units.values())


def test_a_load_past_its_deadline_is_cancelled_and_recomputed():
    clock = Clock()
    sched = make(num_blocks=6, clock=clock)
    run(sched, request("a", PROMPT_A))
    run(sched, request("b", PROMPT_B))
    sched.add_request(request("a2", PROMPT_A))
    sched.schedule()
    assert sched.is_loading_remote_kv()
    clock.now += 6
    step = sched.schedule()
    assert step.kv_connector_metadata.reqs_to_cancel == ["a2"]
    assert step.scheduled_req_ids == ["a2"] and step.num_scheduled_tokens == [13]
    [output] = answer(sched, step, finished=["a2"])  # a late end of the cancelled load is ignored
    assert output.num_cached_tokens == 4 and output.finish_reason  # only the device's block was cached


def test_an_aborted_load_is_cancelled_and_its_host_units_unpinned():
    sched = make(num_blocks=6)
    run(sched, request("a", PROMPT_A))
    run(sched, request("b", PROMPT_B))
    sched.add_request(request("a2", PROMPT_A))
    sched.schedule()
    sched.abort_requests(["a2"])
    assert sched.schedule().kv_connector_metadata.reqs_to_cancel == ["a2"]
    assert not any(u.pins for u in sched.offload.host.units.values())
    assert sched.kv_cache_manager.num_free_blocks == 6


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_swap_stores_a_preempted_requests_blocks_at_once_and_pins_them_until_it_is_back(mode):
    sched = make(num_blocks=8, preemption_mode=mode)
    # Both fit at first (3 blocks each), then grow to 6 blocks each: one is preempted.
    first, second = request("first", PROMPT_A[:9], max_tokens=12), request("second", PROMPT_B[:9], max_tokens=12)
    sched.add_request(first)
    sched.add_request(second)
    while not sched.num_preemptions:
        step = sched.schedule()
        answer(sched, step)
    victim = first if first.status == RequestStatus.PREEMPTED else second
    stores = step.kv_connector_metadata.offload_stores if step.kv_connector_metadata else []
    pinned = [u for u in sched.offload.host.units.values() if u.pins]
    if mode == "swap":
        assert stores and pinned and all(h in victim.block_hashes for u in pinned for h in u.block_hashes)
    else:
        assert not pinned
    loaded = []
    while sched.has_unfinished_requests():
        step = sched.schedule()
        loads = step.kv_connector_metadata.offload_loads if step.kv_connector_metadata else []
        loaded += [load.req_id for load in loads]
        answer(sched, step, finished=[load.req_id for load in loads])
    if mode == "swap":
        assert loaded == [victim.request_id]  # loaded back, not recomputed
    assert not any(u.pins for u in sched.offload.host.units.values())
    assert sched.kv_cache_manager.num_free_blocks == 8


def test_write_through_files_a_finished_requests_units_once(tmp_path):
    sched = make(num_blocks=16, host_slots=4, path=str(tmp_path), policy="write_through")
    steps = run(sched, request("a", PROMPT_A))
    steps += run(sched, request("a-again", PROMPT_A))  # found on the device: nothing new to file
    steps.append(sched.schedule())
    disk_stores = [s for s in stores_of(steps) if s.block_hashes]
    hashes = request("x", PROMPT_A).block_hashes
    assert [s.block_hashes for s in disk_stores] == [hashes[0:2], hashes[2:4]]  # two whole units
    assert all(s.slot < 0 for s in disk_stores)


def test_a_deleted_folder_makes_the_engine_forget_what_it_filed(tmp_path):
    # The engine does not file a unit again for a minute after it filed it; when somebody
    # deletes the folder, those files are gone, and it files them again.
    os.makedirs(tmp_path / "ns")
    clock = Clock()
    sched = make(num_blocks=16, host_slots=4, path=str(tmp_path), policy="write_through", clock=clock)
    hashes = request("x", PROMPT_A).block_hashes

    def filed(req):
        steps = run(sched, req)
        steps.append(sched.schedule())  # the stores of a request's end go with the next step
        return [s.block_hashes for s in stores_of(steps) if s.block_hashes]

    assert filed(request("a", PROMPT_A)) == [hashes[0:2], hashes[2:4]]
    file_unit(tmp_path, hashes[0:2])  # the workers wrote them
    file_unit(tmp_path, hashes[2:4])
    clock.now += 2
    assert filed(request("a-again", PROMPT_A)) == []
    shutil.rmtree(tmp_path / "ns")
    clock.now += 2
    assert filed(request("a-third", PROMPT_A)) == [hashes[0:2], hashes[2:4]]


def test_a_write_through_not_yet_on_disk_is_still_spilled_when_the_host_tier_evicts_it(tmp_path):
    # The workers write write-throughs when the forward pass is idle, or skip them: the host
    # tier's eviction is what keeps the unit then.
    sched = make(num_blocks=6, host_slots=2, path=str(tmp_path), policy="write_through")
    steps = run(sched, request("a", PROMPT_A))
    steps += run(sched, request("b", PROMPT_B))  # A's units go to the host tier
    a_hashes = request("x", PROMPT_A).block_hashes[:4]
    assert [(s.block_hashes, s.write_through) for s in stores_of(steps) if s.block_hashes][:2] == [
        (a_hashes[0:2], True), (a_hashes[2:4], True)]
    file_unit(tmp_path, a_hashes[0:2])  # the workers wrote A's first unit, not its second
    steps = run(sched, request("c", list(range(300, 317))))  # B's units push A's out of the host tier
    spills = [s.block_hashes for step in steps if step.kv_connector_metadata
              for s in step.kv_connector_metadata.offload_spills]
    assert spills == [a_hashes[2:4]]


def test_the_offloading_and_pd_connectors_share_one_metadata():
    sched = make(num_blocks=6, pd=True)
    run(sched, request("a", PROMPT_A))
    run(sched, request("b", PROMPT_B))
    sched.add_request(request("a2", PROMPT_A))  # no kv_transfer_params: the tiers take it
    meta = sched.schedule().kv_connector_metadata
    assert meta.offload_loads and not meta.reqs_to_recv
