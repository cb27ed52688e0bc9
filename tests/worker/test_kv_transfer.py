"""P/D's worker side without a bus: blocks out of one paged cache and into another, and
the chunk plan under a payload limit."""

import pytest
import torch

from services.worker.kv_cache import allocate_kv_caches
from services.worker.kv_transfer.block_io import KVBlockIO
from services.worker.kv_transfer.chunks import Chunk, plan_chunks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_move_between_caches_exactly(dtype):
    src = allocate_kv_caches(10, 4, 2, 8, 3, dtype, torch.device("cpu"))
    dst = allocate_kv_caches(10, 4, 2, 8, 3, dtype, torch.device("cpu"))
    for k, v in src:
        k.copy_(torch.randn(k.shape).to(dtype))
        v.copy_(torch.randn(v.shape).to(dtype))
    source, target = KVBlockIO(src), KVBlockIO(dst)
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
