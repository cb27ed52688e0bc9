"""The batched LoRA delta, each method (masked GEMMs over all slots, grouped bmm over the
slots used, the Triton kernels) against the per-token gather reference, on mixed batches
with base-model tokens."""

from __future__ import annotations

import pytest
import torch

from services.worker.lora.batched import METHODS, LoRABatch, add_lora, choose_method, lora_delta_reference
from kernels.triton_import import HAS_TRITON

CASES = [(1, 8, torch.float32), (4, 48, torch.float32), (8, 16, torch.bfloat16)]


def mixed_batch(num_slots, rank, dtype, num_tokens=37, seed=0, used=None):
    gen = torch.Generator().manual_seed(seed * 1000 + num_slots * 100 + rank)
    in_features, out_features = 64, 96
    x = torch.randn(num_tokens, in_features, generator=gen).to(dtype)
    a_slots = torch.randn(num_slots, rank, in_features, generator=gen).to(dtype)
    b_slots = torch.randn(num_slots, rank, out_features, generator=gen).to(dtype)
    base = torch.randn(num_tokens, out_features, generator=gen).to(dtype)
    # Runs of tokens per request, some on the base model (-1).
    choices = torch.tensor([-1, *(used if used is not None else range(num_slots))])
    slot_index = choices[torch.randint(0, len(choices), (num_tokens,), generator=gen)]
    slot_index[:5] = -1
    return x, a_slots, b_slots, base, slot_index


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("num_slots,rank,dtype", CASES)
def test_every_method_equals_per_token_reference(method, num_slots, rank, dtype):
    if method == "triton" and not HAS_TRITON:
        pytest.skip("Triton is not installed")
    x, a_slots, b_slots, base, slot_index = mixed_batch(num_slots, rank, dtype)
    batch = LoRABatch.build(slot_index, num_slots, dtype, x.device, method)
    got = add_lora(base.clone(), x, a_slots, b_slots, batch)
    assert got.dtype == dtype
    want = base.float() + lora_delta_reference(x.float(), a_slots.float(), b_slots.float(), slot_index)
    tol = 1e-4 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * 10)
    has = slot_index >= 0
    # Base-model tokens get exactly the base output.
    assert torch.equal(got[~has], base[~has])
    # Each slot really contributes (a wrong slot would give another delta).
    assert (got[has] - base[has]).abs().amax() > 1


@pytest.mark.parametrize("used", [[5], [1, 6], [2, 3, 4]])
def test_grouped_uses_only_the_steps_slots(used):
    """Slots used as a range (a view of the weights) or scattered (gathered)."""
    x, a_slots, b_slots, base, slot_index = mixed_batch(8, 16, torch.float32, num_tokens=50, used=used)
    batch = LoRABatch.build(slot_index, 8, torch.float32, x.device, "grouped")
    assert batch.groups.tolist() == used and (batch.group_range is not None) == (used != [1, 6])
    got = add_lora(base.clone(), x, a_slots, b_slots, batch)
    want = base + lora_delta_reference(x, a_slots, b_slots, slot_index)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)


def test_grouped_with_one_slot_for_every_token():
    x, a_slots, b_slots, base, _ = mixed_batch(4, 16, torch.float32)
    slot_index = torch.full((x.shape[0],), 2)
    batch = LoRABatch.build(slot_index, 4, torch.float32, x.device, "grouped")
    assert batch.single_slot == 2
    got = add_lora(base.clone(), x, a_slots, b_slots, batch)
    torch.testing.assert_close(got, base + lora_delta_reference(x, a_slots, b_slots, slot_index), rtol=1e-4, atol=1e-3)


def test_choice_follows_the_measurements():
    assert choose_method(torch.device("cuda")) == "triton"
    assert choose_method(torch.device("cpu")) == "grouped"
    assert LoRABatch.build(torch.tensor([0, -1]), 2, torch.float32, torch.device("cpu")).method == "grouped"


def test_reference_is_zero_without_slots():
    x = torch.randn(3, 4)
    delta = lora_delta_reference(x, torch.randn(2, 5, 4), torch.randn(2, 5, 6), torch.tensor([-1, -1, -1]))
    assert torch.equal(delta, torch.zeros(3, 6))
