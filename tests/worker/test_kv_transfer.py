"""P/D's worker side without a bus: blocks out of one paged cache and into another, the
chunk plan under a payload limit, and rank 0's push of ended loads."""

import asyncio

import pytest
import torch

from services.worker.kv_cache import allocate_kv_caches
from services.worker.kv_transfer.block_io import KVBlockIO
from services.worker.kv_transfer.chunks import Chunk, plan_chunks
from services.worker.kv_transfer.load_reports import LoadReports
from shared.kv_transfer_faults import KVTransferFaults
from shared.protocol import KV_LOADS_DONE, KVLoadsDone, engine_kv_loaded_subject


# The GPU's copy path (torch's index_select / index_copy_ on the device) where there is one.
ON_CUDA_OR_SKIPPED = pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU path needs CUDA")])


@pytest.mark.parametrize("device", ["cpu", ON_CUDA_OR_SKIPPED])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_move_between_caches_exactly(dtype, device):
    src = allocate_kv_caches(10, 4, 2, 8, 3, dtype, torch.device(device))
    dst = allocate_kv_caches(10, 4, 2, 8, 3, dtype, torch.device(device))
    for k, v in src:
        k.copy_(torch.randn(k.shape).to(dtype))
        v.copy_(torch.randn(v.shape).to(dtype))
    source, target = KVBlockIO(src), KVBlockIO(dst)
    assert source.on_cpu == (device == "cpu")
    data = source.gather([7, 2, 5], first_layer=1, num_layers=2)
    assert len(data) == source.chunk_bytes(3, 2) == 3 * 2 * 2 * 4 * 2 * 8 * dtype.itemsize
    target.scatter([0, 9, 4], 1, 2, data)
    for layer in (1, 2):
        for s, d in zip(src[layer], dst[layer]):
            assert torch.equal(d[[0, 9, 4]], s[[7, 2, 5]])
            assert not d[[1, 2, 3, 5, 6, 7, 8]].any()  # nothing else written
    assert not dst[0][0].any() and not dst[0][1].any()  # nor another layer


def test_chunks_take_whole_blocks_under_the_limit_else_runs_of_layers():
    assert plan_chunks(5, 4, 100, 850) == [Chunk(0, 2, 0, 4), Chunk(2, 2, 0, 4), Chunk(4, 1, 0, 4)]
    assert plan_chunks(2, 4, 100, 250) == [Chunk(0, 1, 0, 2), Chunk(0, 1, 2, 2), Chunk(1, 1, 0, 2), Chunk(1, 1, 2, 2)]
    assert all(c.num_blocks * c.num_layers * 100 <= 250 for c in plan_chunks(7, 5, 100, 250))


class _Bus:
    """The worker service as the connector sees it: a task spawner and a connection."""

    def __init__(self):
        self.published = []
        self.nc = self

    def spawn(self, coro):
        return asyncio.get_running_loop().create_task(coro)

    async def publish(self, subject, data, headers=None):
        self.published.append((subject, KV_LOADS_DONE.decode(data)))

    async def subscribe(self, subject, handler):
        pass


async def _settle():
    for _ in range(3):
        await asyncio.sleep(0)


async def _reports(bus, world_size: int, faults=KVTransferFaults()) -> LoadReports:
    reports = LoadReports(bus, "d0", 0, world_size, faults)
    await reports.setup()
    return reports


async def test_rank_0_pushes_ended_loads_only_while_no_step_runs_and_the_next_result_repeats_them():
    bus = _Bus()
    reports = await _reports(bus, 1, KVTransferFaults(drop_load_push="lost"))
    reports.step_started("inc", True)
    reports.take_finished()  # the reset step ends: no step runs now
    reports._record(0, ["a"], [])
    await _settle()
    assert bus.published == [(engine_kv_loaded_subject("d0"), KVLoadsDone("inc", ["a"]))]
    reports._record(0, [], ["lost-1"])  # test fault: this push is lost ...
    await _settle()
    assert len(bus.published) == 1
    assert reports.take_finished() == (["a"], ["lost-1"], 0)  # ... and the next step's result repeats both
    reports.step_started("inc", False)  # a step runs: its result carries the end
    reports._record(0, ["b"], [])
    await _settle()
    assert len(bus.published) == 1
    assert reports.take_finished() == (["b"], [], 0)
    assert reports.take_finished() == ([], [], 0)


async def test_a_load_ended_on_another_thread_is_reported_on_the_event_loop():
    bus = _Bus()
    reports = await _reports(bus, 1)
    reports.step_started("inc", True)
    reports.take_finished()
    await asyncio.to_thread(reports.report_now, "a", False)
    await _settle()
    assert bus.published == [(engine_kv_loaded_subject("d0"), KVLoadsDone("inc", ["a"]))]


async def test_under_tp_rank_0_pushes_a_load_once_every_rank_ended_it():
    bus = _Bus()
    reports = await _reports(bus, 2)
    reports.step_started("inc", True)
    reports.take_finished()
    reports._record(0, ["a"], [])
    await _settle()
    assert bus.published == []
    reports._record(1, ["a"], [])
    await _settle()
    assert bus.published == [(engine_kv_loaded_subject("d0"), KVLoadsDone("inc", ["a"]))]
