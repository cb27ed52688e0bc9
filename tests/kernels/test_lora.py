"""The grouped LoRA kernels (shrink, expand; Triton, interpreted without a GPU) against their
PyTorch references, on mixed batches with base-model tokens and ragged sizes."""

import pytest
import torch

from kernels.lora import lora_expand_ref, lora_expand_triton, lora_shrink_ref, lora_shrink_triton

pytestmark = pytest.mark.cuda

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
TOLERANCES = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}
# (tokens, slots, rank, in, out): the fused qkv at rank 16 with 3 sub-modules, ragged sizes;
# on a GPU also a prefill-sized step over Llama-3.2-1B's fused qkv at rank 64.
SHAPES = [(7, 3, 48, 576, 960), (33, 8, 8, 130, 70), (1, 1, 16, 64, 32)] + (
    [(300, 8, 64, 2048, 3072)] if ON_CUDA else [])


def case(num_tokens, num_slots, rank, in_features, out_features, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, in_features, generator=gen).to(dtype).to(DEVICE)
    a_slots = (torch.randn(num_slots, rank, in_features, generator=gen) / in_features ** 0.5).to(dtype).to(DEVICE)
    b_slots = torch.randn(num_slots, rank, out_features, generator=gen).to(dtype).to(DEVICE)
    y = torch.randn(num_tokens, out_features, generator=gen).to(dtype).to(DEVICE)
    token_slot = torch.randint(-1, num_slots, (num_tokens,), generator=gen).to(DEVICE)
    return x, a_slots, b_slots, y, token_slot


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", list(TOLERANCES))
def test_shrink_and_expand_match_references(shape, dtype):
    x, a_slots, b_slots, y, token_slot = case(*shape, dtype)
    tol = TOLERANCES[dtype]
    h = lora_shrink_triton(x, a_slots, token_slot)
    torch.testing.assert_close(h, lora_shrink_ref(x, a_slots, token_slot), rtol=tol, atol=tol)
    want = lora_expand_ref(y, h, b_slots, token_slot)
    got = lora_expand_triton(y.clone(), h, b_slots, token_slot)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    base = token_slot < 0
    assert torch.equal(got[base], y[base])  # base-model tokens untouched


def test_a_token_reads_only_its_slot():
    """Poison every slot a token does not use: its result must not change."""
    x, a_slots, b_slots, y, _ = case(4, 4, 8, 32, 16, torch.float32)
    token_slot = torch.tensor([2, 2, -1, 0], device=DEVICE)
    want = lora_expand_triton(y.clone(), lora_shrink_triton(x, a_slots, token_slot), b_slots, token_slot)
    for unused in (1, 3):
        a_slots[unused] = float("nan")
        b_slots[unused] = float("nan")
    got = lora_expand_triton(y.clone(), lora_shrink_triton(x, a_slots, token_slot), b_slots, token_slot)
    assert torch.equal(got, want)
