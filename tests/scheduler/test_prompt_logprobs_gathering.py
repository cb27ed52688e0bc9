"""The scheduler's side of prompt logprobs: chunks gathered once, sent with the first output."""

from __future__ import annotations

from services.scheduler.request import Request
from services.scheduler.kv_cache_manager import KVCacheManager
from shared.protocol import Logprobs, PromptLogprobs, SamplingParams


def entry(token: int) -> Logprobs:
    return Logprobs([token], [-0.5], 1)


def test_chunks_are_gathered_in_order_and_a_recomputed_chunk_adds_nothing_twice():
    request = Request("r", [10, 11, 12, 13, 14, 15], SamplingParams(prompt_logprobs=0))
    request.add_prompt_logprobs(PromptLogprobs(1, [entry(11), entry(12)]))  # positions 0-1
    request.add_prompt_logprobs(PromptLogprobs(1, [entry(11), entry(12)]))  # recomputed after a preemption
    request.add_prompt_logprobs(PromptLogprobs(3, [entry(13), entry(14), entry(15)]))
    taken = request.take_prompt_logprobs()
    assert [lp.token_ids[0] for lp in taken] == [10, 11, 12, 13, 14, 15]
    assert taken[0].logprobs == [] and all(lp.logprobs == [-0.5] for lp in taken[1:])
    assert request.take_prompt_logprobs() == []  # once


def test_a_one_token_prompt_and_a_request_without_them():
    one_token = Request("a", [7], SamplingParams(prompt_logprobs=2))
    assert [lp.token_ids for lp in one_token.take_prompt_logprobs()] == [[7]]
    assert Request("b", [7, 8], SamplingParams()).take_prompt_logprobs() == []


def test_no_prefix_cache_hit_for_a_request_that_wants_them():
    manager = KVCacheManager(num_blocks=16, block_size=4)
    first = Request("first", list(range(12)), SamplingParams(), block_size=4)
    manager.allocate_slots(first, 12)
    manager.free(first)
    again = Request("again", list(range(12)), SamplingParams(), block_size=4)
    assert manager.get_computed_blocks(again)[1] == 8
    wanting = Request("wanting", list(range(12)), SamplingParams(prompt_logprobs=1), block_size=4)
    assert manager.get_computed_blocks(wanting) == ([[]], 0)
