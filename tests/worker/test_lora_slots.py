"""The worker's LoRA slots: LRU eviction with pinned adapters kept, the host cache bound,
and each token's slot."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.worker.lora.slots import LoRASlots
from shared.config import LoRAConfig
from shared.protocol import LoRARequest
from tests.lora_reference import make_peft_adapter


@pytest.fixture(scope="module")
def loras(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-loras")
    hf = tiny_llama[1]
    return {name: LoRARequest(name, str(make_peft_adapter(hf, root / name, rank=4, alpha=8, targets=["q_proj"],
                                                          seed=i)))
            for i, name in enumerate("ABC")}


@pytest.fixture
def slots(tiny_llama):
    worker = tiny_llama[0]
    config = LoRAConfig(enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=2)
    slots = LoRASlots(worker.model, worker.model_config, config, torch.device("cpu"), torch.float32)
    yield slots
    slots.detach()


def resident(slots) -> dict[str, int]:
    return {key[0]: slot for key, slot in slots.resident.items()}


def test_least_recently_used_slot_is_evicted_but_never_a_pinned_one(slots, loras):
    a, b, c = loras["A"], loras["B"], loras["C"]
    slots.set_step([a, b], np.array([1, 1]))
    assert resident(slots) == {"A": 0, "B": 1}
    slots.set_step([b], np.array([1]))
    slots.set_step([c], np.array([1]))  # A was used least recently
    assert resident(slots) == {"B": 1, "C": 0}
    slots.pin(b)
    slots.set_step([a], np.array([1]))  # B is older than C, but pinned
    assert resident(slots) == {"B": 1, "A": 0}
    assert len(slots.host_cache) == 2  # --max-cpu-loras
    with pytest.raises(RuntimeError, match="more LoRA adapters than the 2 slots"):
        slots.set_step([a, b, c], np.array([1, 1, 1]))


def test_a_request_marked_pinned_pins_its_adapter_until_unpinned(slots, loras, caplog):
    a, b, c = loras["A"], loras["B"], loras["C"]
    pinned_b = LoRARequest(b.lora_name, b.lora_path, pinned=True)
    slots.set_step([pinned_b, a], np.array([1, 1]))
    slots.set_step([c], np.array([1]))
    slots.set_step([a], np.array([1]))
    assert resident(slots) == {"B": 0, "A": 1}
    slots.unpin("B")
    slots.set_step([c], np.array([1]))  # B is used least recently and no longer pinned
    assert resident(slots) == {"A": 1, "C": 0}
    # A scheduler that did not hear of a pin (it restarted) may need the slot: it is served.
    slots.set_step([pinned_b], np.array([1]))
    with caplog.at_level("WARNING"):
        slots.set_step([a, c], np.array([1, 1]))
    assert resident(slots) == {"A": 1, "C": 0} and "was pinned" in caplog.text


def test_tokens_get_their_requests_slots(slots, loras):
    slots.set_step([None, None], np.array([3, 1]))
    assert slots.batch is None  # no adapter in the step: the projections skip LoRA
    slots.set_step([None, loras["B"], loras["A"]], np.array([2, 3, 1]))
    b, a = slots.resident[("B", loras["B"].lora_path)], slots.resident[("A", loras["A"].lora_path)]
    assert slots.batch.token_slot.tolist() == [-1, -1, b, b, b, a]


def test_detach_restores_the_plain_projections(tiny_llama):
    worker = tiny_llama[0]
    attn = worker.model.layers[0].self_attn
    before = attn.qkv_proj.proj
    slots = LoRASlots(worker.model, worker.model_config, LoRAConfig(enable_lora=True), torch.device("cpu"),
                      torch.float32)
    assert attn.qkv_proj.proj is not before
    slots.detach()
    assert attn.qkv_proj.proj is before
