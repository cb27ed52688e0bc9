"""The rotary embedding fused with the KV write: the CPU path (one C call) and the Triton
composition against the PyTorch reference, on q/k/v slices of one fused qkv tensor."""

import pytest
import torch

from kernels.rotary import compute_cos_sin_cache
from kernels.rotary_write_kv import _kernel_cpu, rotary_write_kv_cpu, rotary_write_kv_ref, rotary_write_kv_triton

ON_CUDA = torch.cuda.is_available()
MAX_POSITION = 4096
# (num_tokens, num_heads, num_kv_heads, head_dim, block_size, num_blocks)
SHAPES = [(1, 9, 3, 64, 16, 8), (7, 4, 2, 128, 4, 6), (300, 9, 3, 64, 16, 32), (5, 6, 2, 80, 8, 4)]


def make_inputs(num_tokens, num_heads, num_kv_heads, head_dim, block_size, num_blocks, dtype, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=gen).to(device, dtype)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    positions = torch.randint(0, MAX_POSITION, (num_tokens,), generator=gen).to(device)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, generator=gen).to(device, dtype)
    value_cache = torch.randn(shape, generator=gen).to(device, dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[1::3] = -1  # padding tokens
    return positions, qkv, (q, k, v), key_cache, value_cache, slots.to(device)


def run(fn, positions, qkv, qkv_views, key_cache, value_cache, slots, head_dim):
    cache = compute_cos_sin_cache(head_dim, MAX_POSITION, 10000.0).to(qkv.device)
    fn(positions, *qkv_views, cache, head_dim, key_cache, value_cache, slots)


needs_c_kernel = pytest.mark.skipif(_kernel_cpu(torch.float32, torch.float32) is None,
                                    reason="no C compiler: the C kernel cannot be built here")


@needs_c_kernel
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_path_equals_reference_bit_for_bit(shape, dtype, cpu_isa):
    head_dim = shape[3]
    expected = make_inputs(*shape, dtype, seed=shape[0])
    got = make_inputs(*shape, dtype, seed=shape[0])
    run(rotary_write_kv_ref, *expected, head_dim)
    run(rotary_write_kv_cpu, *got, head_dim)
    for want, have in zip((expected[1], expected[3], expected[4]), (got[1], got[3], got[4])):
        assert torch.equal(want, have)  # qkv (v untouched), key cache, value cache
    assert not torch.equal(got[3], make_inputs(*shape, dtype, seed=shape[0])[3]), "nothing was written"


@needs_c_kernel
@pytest.mark.parametrize("shape", SHAPES)
def test_float32_rows_into_bfloat16_caches_equal_the_reference_bit_for_bit(shape, cpu_isa):
    # --kv-cache-dtype bfloat16 under a float32 model: the rotated k and v rounded to bf16
    # once, as the reference's conversion rounds them; q keeps float32.
    head_dim = shape[3]
    expected, got = (make_inputs(*shape, torch.float32, seed=shape[0]) for _ in range(2))
    for inputs in (expected, got):
        inputs[3].data, inputs[4].data = inputs[3].bfloat16(), inputs[4].bfloat16()
    run(rotary_write_kv_ref, *expected, head_dim)
    run(rotary_write_kv_cpu, *got, head_dim)
    assert got[3].dtype == torch.bfloat16
    for want, have in zip((expected[1], expected[3], expected[4]), (got[1], got[3], got[4])):
        assert torch.equal(want, have)
    positions, qkv, (q, k, v), key_cache, _, slots = got
    written = slots >= 0
    assert torch.equal(key_cache.view(-1, *key_cache.shape[2:])[slots[written]],
                       k[written].view(-1, *key_cache.shape[2:]).bfloat16())


def test_cpu_path_without_the_c_kernel_equals_reference(monkeypatch):
    import kernels.rotary_write_kv as module

    monkeypatch.setattr(module, "_kernel_cpu", lambda dtype, cache_dtype: None)
    expected = make_inputs(*SHAPES[1], torch.bfloat16, seed=3)
    got = make_inputs(*SHAPES[1], torch.bfloat16, seed=3)
    run(rotary_write_kv_ref, *expected, 128)
    run(rotary_write_kv_cpu, *got, 128)
    assert all(torch.equal(a, b) for a, b in zip((expected[1], expected[3]), (got[1], got[3])))


@pytest.mark.parametrize("bad", ["position", "slot"])
def test_cpu_path_refuses_out_of_range_and_writes_nothing(bad):
    positions, qkv, views, key_cache, value_cache, slots = make_inputs(*SHAPES[0], torch.float32)
    if bad == "position":
        positions = torch.tensor([MAX_POSITION])
    else:
        slots = torch.tensor([8 * 16])  # one past the last slot
    before = qkv.clone(), key_cache.clone(), value_cache.clone()
    with pytest.raises(IndexError):
        run(rotary_write_kv_cpu, positions, qkv, views, key_cache, value_cache, slots, 64)
    assert all(torch.equal(a, b) for a, b in zip(before, (qkv, key_cache, value_cache)))


# On a GPU also a prefill chunk of Llama-3-8B's heads over many blocks.
TRITON_SHAPES = [(7, 4, 2, 64, 4, 6)] + ([(300, 32, 8, 128, 16, 40)] if ON_CUDA else [])


@pytest.mark.cuda
@pytest.mark.parametrize("shape", TRITON_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_matches_reference(shape, dtype):
    device = "cuda" if ON_CUDA else "cpu"
    head_dim = shape[3]
    expected = make_inputs(*shape, dtype, seed=5, device=device)
    got = make_inputs(*shape, dtype, seed=5, device=device)
    run(rotary_write_kv_ref, *expected, head_dim)
    run(rotary_write_kv_triton, *got, head_dim)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for want, have in zip((expected[1], expected[3], expected[4]), (got[1], got[3], got[4])):
        torch.testing.assert_close(have, want, rtol=tol, atol=tol)
