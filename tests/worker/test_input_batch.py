"""The persistent batch keeps rows, sampling settings included, consistent through
adds, removes and condense, and hands the sampler the settings of the rows that sample."""

import numpy as np
import pytest
import torch

from services.worker.input_batch import CachedRequestState, InputBatch
from shared.protocol import SamplingParams


def make_state(req_id, n):
    return CachedRequestState(req_id, list(range(n)), n, SamplingParams(), [[n, n + 1]], 0, None)


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
    batch.append_block_ids(1, [[9]])
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


def add(batch, req_id, params, prompt=(1, 2), output=(), eos=None):
    generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
    state = CachedRequestState(req_id, list(prompt) + list(output), len(prompt), params, [[0]], 0, eos,
                               generator=generator, output_token_ids=list(output))
    batch.add_request(state)
    return state


def test_sampling_settings_move_with_their_rows():
    batch = InputBatch(max_num_reqs=4, max_model_len=16, max_blocks_per_req=1)
    add(batch, "r0", SamplingParams(temperature=0))
    add(batch, "r1", SamplingParams(temperature=0.5, top_k=5))
    add(batch, "r2", SamplingParams(temperature=0.7, min_tokens=2, stop_token_ids=[9]), eos=3)
    seeded = add(batch, "r3", SamplingParams(temperature=0.9, top_p=0.8, seed=7, logprobs=2))
    batch.remove_request("r0")
    batch.condense()
    assert batch.req_ids == ["r3", "r1", "r2"]
    meta = batch.make_sampling_metadata(np.arange(3))
    assert meta.temperature.tolist() == pytest.approx([0.9, 0.5, 0.7])
    assert meta.top_k.tolist() == [0, 5, 0] and meta.top_p.tolist() == pytest.approx([0.8, 1, 1])
    assert meta.generators == {0: seeded.generator}
    assert meta.banned == ([2, 2], [9, 3])
    assert meta.num_logprobs == [2, -1, -1]
    assert not meta.all_greedy and meta.any_top_k and meta.any_top_p and not meta.any_min_p
    assert not meta.any_penalties and meta.prompt_token_ids is None


def test_sampling_metadata_of_the_rows_that_sample():
    batch = InputBatch(max_num_reqs=3, max_model_len=16, max_blocks_per_req=1)
    penalized = SamplingParams(temperature=0, repetition_penalty=1.2, min_tokens=3)
    add(batch, "r0", penalized, prompt=(1, 2, 3), output=(4,), eos=5)
    add(batch, "r1", SamplingParams(temperature=1.0, seed=1))
    seeded = add(batch, "r2", SamplingParams(temperature=0, seed=2), prompt=(6,), output=(7, 8, 9))
    meta = batch.make_sampling_metadata(np.array([0, 2]))  # r1 is mid-prompt
    assert meta.all_greedy and meta.any_penalties
    assert meta.repetition_penalty.tolist() == pytest.approx([1.2, 1.0])
    assert meta.generators == {1: seeded.generator}
    assert meta.banned == ([0], [5])
    assert meta.prompt_token_ids.tolist() == [[1, 2, 3], [6, -1, -1]]
    assert meta.output_token_ids.tolist() == [[4, -1, -1], [7, 8, 9]]
    batch.append_token(0, 11)
    batch.append_token(0, 12)
    meta = batch.make_sampling_metadata(np.array([0, 2]))
    assert meta.banned is None  # r0 reached min_tokens
    assert meta.output_token_ids[0].tolist() == [4, 11, 12]


def test_the_metadata_of_every_row_is_reused_until_a_row_changes():
    batch = InputBatch(max_num_reqs=4, max_model_len=32, max_blocks_per_req=4)
    batch.add_request(make_state("r0", 3))
    first = batch.make_sampling_metadata(np.arange(1))
    assert batch.make_sampling_metadata(np.arange(1)) is first
    batch.add_request(CachedRequestState("r1", [1, 2], 2, SamplingParams(temperature=0.5), [[3]], 0, None))
    second = batch.make_sampling_metadata(np.arange(2))
    assert second is not first and second.temperature.tolist() == [1.0, 0.5]
    batch.remove_request("r1")
    batch.condense()
    third = batch.make_sampling_metadata(np.arange(1))
    assert third is not second and len(third.temperature) == 1
    # Penalties read each step's output ids: never reused.
    batch.add_request(CachedRequestState("r2", [1, 2], 2, SamplingParams(presence_penalty=0.5), [[3]], 0, None))
    rows = np.arange(batch.num_reqs)
    assert batch.make_sampling_metadata(rows) is not batch.make_sampling_metadata(rows)
