"""The persistent batch keeps rows consistent through adds, removes and condense."""

from services.worker.input_batch import CachedRequestState, InputBatch
from shared.protocol import SamplingParams


def make_state(req_id, n):
    return CachedRequestState(req_id, list(range(n)), n, SamplingParams(), [n, n + 1], 0, None)


def test_condense_moves_last_rows_into_holes():
    batch = InputBatch(max_num_reqs=4, max_model_len=32, max_blocks_per_req=4)
    for i, n in enumerate([3, 4, 5, 6]):
        batch.add_request(make_state(f"r{i}", n))
    batch.remove_request("r0")
    batch.remove_request("r2")
    batch.condense()
    assert batch.req_ids == ["r3", "r1"]
    assert batch.req_id_to_index == {"r3": 0, "r1": 1}
    assert batch.num_tokens[:2].tolist() == [6, 4]
    assert batch.token_ids[0, :6].tolist() == list(range(6))
    assert batch.block_table[0, :2].tolist() == [6, 7]
    batch.append_block_ids(1, [9])
    assert batch.block_table[1, :3].tolist() == [4, 5, 9] and batch.num_blocks[1] == 3
    batch.append_token(1, 42)
    assert batch.token_ids[1, 4] == 42 and batch.num_tokens[1] == 5


def test_condense_of_trailing_holes_only_shrinks():
    batch = InputBatch(max_num_reqs=3, max_model_len=8, max_blocks_per_req=2)
    for i in range(3):
        batch.add_request(make_state(f"r{i}", 2))
    batch.remove_request("r2")
    batch.remove_request("r1")
    batch.condense()
    assert batch.req_ids == ["r0"] and batch.num_reqs == 1
