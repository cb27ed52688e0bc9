"""The CPU LoRA kernel (kernels/cpu/lora.c, one call per projection) against the per-token
reference, on both instruction-set builds: float32 and bfloat16, mixed slots with
base-model tokens, ranks 8, 16 and 64, ragged sizes, strided rows and fused projections
with block-diagonal B."""

import pytest
import torch

from kernels.lora_cpu import add_lora_cpu, lora_cpu_available
from services.worker.lora.batched import lora_delta_reference

# (tokens, slots, stacked rank, in, out splits): qkv and gate_up of the default model at
# ranks 16 and 8 (3 and 2 sub-modules), o / down at rank 64, and ragged sizes (a vector tail
# in `in`, a column block not whole, rank not a multiple of the kernel's row block).
SHAPES = [
    (37, 8, 48, 576, (576, 192, 192)),
    (32, 8, 16, 576, (1536, 1536)),
    (19, 4, 64, 1536, (576,)),
    (5, 3, 8, 130, (70,)),
    (300, 8, 6, 77, (33, 30)),
    (1, 1, 16, 64, (32,)),
]
TOLERANCES = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def case(num_tokens, num_slots, rank, in_features, out_splits, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out_features = sum(out_splits)
    x = torch.randn(num_tokens, in_features, generator=gen).to(dtype)
    a_slots = (torch.randn(num_slots, rank, in_features, generator=gen) / in_features ** 0.5).to(dtype)
    b_slots = torch.randn(num_slots, rank, out_features, generator=gen)
    # B block-diagonal as a fused projection's (adapter.py): sub-module m's rank rows
    # reach only its output columns.
    rows, col = rank // len(out_splits), 0
    for m, width in enumerate(out_splits):
        b_slots[:, m * rows:(m + 1) * rows, :col] = 0
        b_slots[:, m * rows:(m + 1) * rows, col + width:] = 0
        col += width
    y = torch.randn(num_tokens, out_features, generator=gen).to(dtype)
    token_slot = torch.randint(-1, num_slots, (num_tokens,), generator=gen)
    token_slot[0] = num_slots - 1  # the last slot and a base-model token, at least
    token_slot[num_tokens // 2:][:1] = -1 if num_tokens > 1 else num_slots - 1
    return x, a_slots, b_slots.to(dtype), y, token_slot


def skip_without_kernel(dtype):
    if not lora_cpu_available(dtype):
        pytest.skip("no C compiler: the C kernel cannot be built here")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", list(TOLERANCES))
def test_kernel_matches_reference(shape, dtype, cpu_isa):
    skip_without_kernel(dtype)
    x, a_slots, b_slots, y, token_slot = case(*shape, dtype)
    got = y.clone()
    assert add_lora_cpu(got, x, a_slots, b_slots, token_slot, shape[4])
    want = y.float() + lora_delta_reference(x.float(), a_slots.float(), b_slots.float(), token_slot)
    tol = TOLERANCES[dtype]
    # bf16: the float32 sum rounded once to y's bfloat16 (the reference is float32)
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    has_slot = token_slot >= 0
    assert torch.equal(got[~has_slot], y[~has_slot])  # base-model rows untouched, bit for bit
    assert (got[has_slot].float() - y[has_slot].float()).abs().amax() > 0.1  # the deltas are there


@pytest.mark.parametrize("dtype", list(TOLERANCES))
def test_without_splits_every_row_of_b_counts(dtype, cpu_isa):
    """With one block (no splits) the kernel multiplies all of B: a dense B gives the full delta."""
    skip_without_kernel(dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(23, 96, generator=gen).to(dtype)
    a_slots = (torch.randn(5, 24, 96, generator=gen) / 10).to(dtype)
    b_slots = torch.randn(5, 24, 200, generator=gen).to(dtype)
    y = torch.zeros(23, 200, dtype=dtype)
    token_slot = torch.tensor([i % 6 - 1 for i in range(23)])
    assert add_lora_cpu(y, x, a_slots, b_slots, token_slot)
    want = lora_delta_reference(x.float(), a_slots.float(), b_slots.float(), token_slot)
    torch.testing.assert_close(y.float(), want, rtol=TOLERANCES[dtype], atol=TOLERANCES[dtype])


def test_strided_rows_and_threads(cpu_isa):
    """x and y as column slices of wider rows; a step big enough for the threads to split it."""
    skip_without_kernel(torch.float32)
    x_wide = torch.randn(400, 600)
    y_wide = torch.randn(400, 1000)
    x, y = x_wide[:, 10:586], y_wide[:, 20:980]
    a_slots, b_slots = torch.randn(8, 16, 576) / 24, torch.randn(8, 16, 960)
    token_slot = torch.randint(-1, 8, (400,))
    before = y_wide.clone()
    want = y + lora_delta_reference(x, a_slots, b_slots, token_slot)
    assert add_lora_cpu(y, x, a_slots, b_slots, token_slot)
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(y_wide[:, :20], before[:, :20]) and torch.equal(y_wide[:, 980:], before[:, 980:])


def test_refuses_what_it_cannot_take():
    """Mixed dtypes, non-contiguous slots or splits that do not add up: y untouched, False."""
    x, a_slots, b_slots, y, token_slot = case(9, 2, 8, 64, (32,), torch.float32)
    before = y.clone()
    assert not add_lora_cpu(y, x.to(torch.bfloat16), a_slots, b_slots, token_slot)
    assert not add_lora_cpu(y, x, a_slots.transpose(1, 2).contiguous().transpose(1, 2), b_slots, token_slot)
    assert not add_lora_cpu(y, x, a_slots, b_slots, token_slot, (16, 15))
    assert not add_lora_cpu(y, x, a_slots, b_slots, token_slot.to(torch.int32))
    assert torch.equal(y, before)
