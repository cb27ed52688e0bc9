"""The batched LoRA delta, each method (masked GEMMs over all slots, grouped bmm over the
slots used, the C kernel, the Triton kernels) against the per-token gather reference, on
mixed batches with base-model tokens."""

from __future__ import annotations

import pytest
import torch

from services.worker.lora.batched import METHODS, LoRABatch, add_lora, choose_method, lora_delta_reference
from kernels.lora_cpu import lora_cpu_available
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


def test_choice_follows_the_measurements(monkeypatch):
    import services.worker.lora.batched as batched

    assert choose_method(torch.device("cuda")) == "triton"
    for dtype in (torch.float32, torch.bfloat16):
        cpu = "bgmv" if lora_cpu_available(dtype) else "grouped"
        assert choose_method(torch.device("cpu"), dtype) == cpu
        assert LoRABatch.build(torch.tensor([0, -1]), 2, dtype, torch.device("cpu")).method == cpu
    if lora_cpu_available(torch.bfloat16):  # a long bf16 prefill under one adapter: the GEMMs
        long = batched.GEMM_MIN_TOKENS_ONE_SLOT
        assert LoRABatch.build(torch.full((long,), 3), 4, torch.bfloat16, torch.device("cpu")).method == "grouped"
        mixed = torch.full((long,), 3)
        mixed[0] = -1
        assert LoRABatch.build(mixed, 4, torch.bfloat16, torch.device("cpu")).method == "bgmv"
        assert LoRABatch.build(torch.full((long - 1,), 3), 4, torch.bfloat16, torch.device("cpu")).method == "bgmv"
    monkeypatch.setattr(batched, "lora_cpu_available", lambda dtype: False)  # no C compiler
    assert choose_method(torch.device("cpu"), torch.bfloat16) == "grouped"


def test_bgmv_with_fused_splits_and_strided_input():
    """The worker's call: B block-diagonal with its sub-modules' widths; an input the
    kernel does not take (a transposed view) is still right, by the reference."""
    x, a_slots, b_slots, base, slot_index = mixed_batch(4, 16, torch.float32)
    b_slots[:, :8, 64:] = 0  # two sub-modules of 64 and 32 output columns, 8 rank rows each
    b_slots[:, 8:, :64] = 0
    batch = LoRABatch.build(slot_index, 4, torch.float32, x.device, "bgmv")
    want = base + lora_delta_reference(x, a_slots, b_slots, slot_index)
    got = add_lora(base.clone(), x, a_slots, b_slots, batch, (64, 32))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
    strided_x = x.t().contiguous().t()
    assert strided_x.stride(1) != 1
    got = add_lora(base.clone(), strided_x, a_slots, b_slots, batch, (64, 32))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)


def test_reference_is_zero_without_slots():
    x = torch.randn(3, 4)
    delta = lora_delta_reference(x, torch.randn(2, 5, 4), torch.randn(2, 5, 6), torch.tensor([-1, -1, -1]))
    assert torch.equal(delta, torch.zeros(3, 6))
