"""LoRA in the scheduler: at most max_loras distinct adapters run, FIFO behind a waiting
adapter; the adapter is sent once in the new-request data and keys the prefix cache."""

from __future__ import annotations

import pytest

from services.scheduler.request import Request
from services.scheduler.scheduler import RequestRejected, Scheduler
from shared.config import CacheConfig, SchedulerConfig
from shared.protocol import SCHEDULER_OUTPUT, LoRARequest, SamplingParams

PARAMS = SamplingParams(max_tokens=4)
LORAS = {name: LoRARequest(name, f"/adapters/{name}") for name in "ABC"}


def request(req_id: str, lora: str | None, tokens=(1, 2, 3, 4, 5)) -> Request:
    return Request(req_id, list(tokens), PARAMS, lora_request=LORAS.get(lora))


def new_ids(output) -> list[str]:
    return [new.req_id for new in output.scheduled_new_reqs]


def test_distinct_adapters_are_capped_and_admission_stays_fifo():
    scheduler = Scheduler(SchedulerConfig(), CacheConfig(), num_blocks=64, max_model_len=256, max_loras=2)
    for req_id, lora in [("a1", "A"), ("b1", "B"), ("c1", "C"), ("a2", "A"), ("base", None)]:
        scheduler.add_request(request(req_id, lora))
    first = scheduler.schedule()
    # c1 needs a third adapter: it waits, and so do the requests behind it.
    assert new_ids(first) == ["a1", "b1"]
    decoded = SCHEDULER_OUTPUT.decode(SCHEDULER_OUTPUT.encode(first))
    assert [new.lora_request for new in decoded.scheduled_new_reqs] == [LORAS["A"], LORAS["B"]]
    scheduler.abort_requests(["a1"])
    second = scheduler.schedule(allow_preemption=False)
    # A's only request is gone: C gets its slot; a2 (A again) waits behind the running B and C.
    assert new_ids(second) == ["c1"]
    scheduler.abort_requests(["b1"])
    assert new_ids(scheduler.schedule(allow_preemption=False)) == ["a2", "base"]
    # Requests already sent are not sent again with their adapter.
    assert not scheduler.schedule(allow_preemption=False).scheduled_new_reqs


def test_one_adapter_slot_runs_one_adapter_with_base_requests():
    scheduler = Scheduler(SchedulerConfig(), CacheConfig(), num_blocks=64, max_model_len=256, max_loras=1)
    for req_id, lora in [("base1", None), ("a1", "A"), ("a2", "A"), ("base2", None), ("b1", "B")]:
        scheduler.add_request(request(req_id, lora))
    assert new_ids(scheduler.schedule()) == ["base1", "a1", "a2", "base2"]


def test_requests_with_an_adapter_need_enable_lora():
    scheduler = Scheduler(SchedulerConfig(), CacheConfig(), num_blocks=64, max_model_len=256)
    with pytest.raises(RequestRejected, match="without enable_lora"):
        scheduler.add_request(request("a1", "A"))


def test_block_hashes_are_keyed_by_adapter():
    tokens = list(range(40))
    plain = Request("p", tokens, PARAMS, block_size=16)
    under_a = Request("a", tokens, PARAMS, block_size=16, lora_request=LORAS["A"])
    under_a_again = Request("a2", tokens, PARAMS, block_size=16, lora_request=LORAS["A"])
    under_b = Request("b", tokens, PARAMS, block_size=16, lora_request=LORAS["B"])
    moved_a = Request("m", tokens, PARAMS, block_size=16, lora_request=LoRARequest("A", "/elsewhere"))
    salted = Request("s", tokens, PARAMS, block_size=16, cache_salt="A")
    assert under_a.block_hashes == under_a_again.block_hashes
    chains = [plain, under_a, under_b, moved_a, salted]
    for i, one in enumerate(chains):
        for other in chains[i + 1:]:
            assert not set(one.block_hashes) & set(other.block_hashes)


def test_a_pinned_adapter_keeps_its_slot_counted_until_unloaded():
    scheduler = Scheduler(SchedulerConfig(), CacheConfig(), num_blocks=64, max_model_len=256, max_loras=2)
    pinned = LoRARequest("P", "/adapters/P", pinned=True)
    scheduler.add_request(Request("p1", [1, 2, 3], PARAMS, lora_request=pinned))
    assert new_ids(scheduler.schedule()) == ["p1"]
    scheduler.abort_requests(["p1"])
    # P runs no request, but the workers keep it in a slot: one slot is left for A and B.
    for req_id, lora in [("a1", "A"), ("b1", "B")]:
        scheduler.add_request(request(req_id, lora))
    assert new_ids(scheduler.schedule(allow_preemption=False)) == ["a1"]
    scheduler.unpin_loras(["P"])
    assert new_ids(scheduler.schedule(allow_preemption=False)) == ["b1"]


def test_stats_name_the_running_and_waiting_adapters():
    scheduler = Scheduler(SchedulerConfig(), CacheConfig(), num_blocks=64, max_model_len=256, max_loras=2)
    for req_id, lora in [("a1", "A"), ("b1", "B"), ("base", None), ("c1", "C"), ("a2", "A")]:
        scheduler.add_request(request(req_id, lora))
    scheduler.schedule()
    stats = scheduler.stats()
    assert (stats["running_lora_adapters"], stats["waiting_lora_adapters"], stats["max_lora"]) == \
        (["A", "B"], ["A", "C"], 2)
    assert "max_lora" not in Scheduler(SchedulerConfig(), CacheConfig(), num_blocks=64, max_model_len=256).stats()
