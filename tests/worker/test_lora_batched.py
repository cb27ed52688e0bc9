"""The batched LoRA shrink/expand (one GEMM each over all slots) against the per-token
gather reference, on mixed batches with base-model tokens."""

from __future__ import annotations

import pytest
import torch

from services.worker.lora.batched import add_lora, lora_delta_reference


@pytest.mark.parametrize("num_slots,rank,dtype", [(1, 8, torch.float32), (4, 48, torch.float32),
                                                  (8, 16, torch.bfloat16)])
def test_batched_lora_equals_per_token_reference(num_slots, rank, dtype):
    gen = torch.Generator().manual_seed(num_slots * 100 + rank)
    num_tokens, in_features, out_features = 37, 64, 96
    x = torch.randn(num_tokens, in_features, generator=gen).to(dtype)
    a_slots = torch.randn(num_slots, rank, in_features, generator=gen).to(dtype)
    b_slots = torch.randn(out_features, num_slots, rank, generator=gen).to(dtype)
    base = torch.randn(num_tokens, out_features, generator=gen).to(dtype)
    # Runs of tokens per request, some on the base model (-1).
    slot_index = torch.randint(-1, num_slots, (num_tokens,), generator=gen)
    slot_index[:5] = -1
    token_slots = torch.zeros(num_tokens, num_slots, dtype=dtype)
    has = slot_index >= 0
    token_slots[has.nonzero().squeeze(1), slot_index[has]] = 1

    got = add_lora(base.clone(), x, a_slots, b_slots, token_slots)
    want = base.float() + lora_delta_reference(x.float(), a_slots.float(), b_slots.float(), slot_index)
    tol = 1e-4 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * 10)
    # Base-model tokens get exactly the base output.
    assert torch.equal(got[~has], base[~has])
    # Each slot really contributes (a wrong slot would give another delta).
    assert (got[has] - base[has]).abs().amax() > 1


def test_reference_is_zero_without_slots():
    x = torch.randn(3, 4)
    delta = lora_delta_reference(x, torch.randn(2, 5, 4), torch.randn(6, 2, 5), torch.tensor([-1, -1, -1]))
    assert torch.equal(delta, torch.zeros(3, 6))
