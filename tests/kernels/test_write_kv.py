"""write_kv: the Triton kernel against the PyTorch reference, and the reference against a
per-token loop; negative slots must leave the cache untouched."""

import pytest
import torch

from kernels.write_kv import write_kv_cpu, write_kv_ref, write_kv_triton

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
# (num_tokens, num_blocks, block_size, num_kv_heads, head_dim)
SHAPES = (
    [(1, 64, 16, 8, 128), (300, 512, 16, 8, 128), (97, 128, 16, 3, 64)]
    if ON_CUDA
    else [(1, 8, 16, 2, 64), (11, 6, 4, 3, 64), (9, 4, 16, 1, 128)]
)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def make_inputs(num_tokens, num_blocks, block_size, num_kv_heads, head_dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    # K and V as slices of one fused qkv-like tensor, so their token stride is not dense.
    kv = torch.randn(num_tokens, 2 * num_kv_heads + 1, head_dim, generator=gen).to(DEVICE, dtype)
    key, value = kv[:, :num_kv_heads], kv[:, num_kv_heads : 2 * num_kv_heads]
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(cache_shape, generator=gen).to(DEVICE, dtype)
    value_cache = torch.randn(cache_shape, generator=gen).to(DEVICE, dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::3] = -1  # padding tokens
    return key, value, key_cache, value_cache, slots.to(DEVICE)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_matches_reference(shape, dtype):
    key, value, key_cache, value_cache, slots = make_inputs(*shape, dtype)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    write_kv_ref(key, value, expected_k, expected_v, slots)
    write_kv_triton(key, value, key_cache, value_cache, slots)
    torch.testing.assert_close(key_cache, expected_k, rtol=0, atol=0)
    torch.testing.assert_close(value_cache, expected_v, rtol=0, atol=0)


@pytest.mark.parametrize("write_kv", [write_kv_ref, pytest.param(write_kv_triton, marks=pytest.mark.cuda)])
def test_matches_per_token_loop_and_skips_negative_slots(write_kv):
    key, value, key_cache, value_cache, slots = make_inputs(11, 6, 4, 3, 64, torch.float32)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    block_size = key_cache.shape[1]
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected_k[slot // block_size, slot % block_size] = key[t]
            expected_v[slot // block_size, slot % block_size] = value[t]
    write_kv(key, value, key_cache, value_cache, slots)
    torch.testing.assert_close(key_cache, expected_k, rtol=0, atol=0)
    torch.testing.assert_close(value_cache, expected_v, rtol=0, atol=0)


@pytest.mark.parametrize("write_kv", [write_kv_ref, pytest.param(write_kv_triton, marks=pytest.mark.cuda)])
def test_all_negative_slots_write_nothing(write_kv):
    key, value, key_cache, value_cache, _ = make_inputs(5, 4, 4, 2, 64, torch.float32)
    before_k, before_v = key_cache.clone(), value_cache.clone()
    write_kv(key, value, key_cache, value_cache, torch.full((5,), -1, device=DEVICE))
    assert torch.equal(key_cache, before_k) and torch.equal(value_cache, before_v)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("padding", [False, True])
def test_cpu_path_matches_reference(shape, dtype, padding, cpu_isa):
    key, value, key_cache, value_cache, slots = make_inputs(*shape, dtype)
    if not padding:
        slots = torch.randperm(shape[1] * shape[2])[: shape[0]].to(slots.device)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    write_kv_ref(key, value, expected_k, expected_v, slots)
    write_kv_cpu(key, value, key_cache, value_cache, slots)
    torch.testing.assert_close(key_cache, expected_k, rtol=0, atol=0)
    torch.testing.assert_close(value_cache, expected_v, rtol=0, atol=0)


@pytest.mark.skipif(ON_CUDA, reason="bfloat16 caches under a float32 model are a CPU option")
@pytest.mark.parametrize("padding", [False, True])
def test_float32_rows_into_bfloat16_caches_round_once(padding, cpu_isa):
    # --kv-cache-dtype bfloat16 under a float32 model: each value rounded to bf16 as
    # PyTorch's conversion rounds it, in both paths.
    key, value, key_cache, value_cache, slots = make_inputs(11, 6, 4, 3, 64, torch.float32)
    if not padding:
        slots = torch.randperm(6 * 4)[:11]
    key_cache, value_cache = key_cache.bfloat16(), value_cache.bfloat16()
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    write_kv_ref(key, value, expected_k, expected_v, slots)
    write_kv_cpu(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)
    written = slots >= 0
    assert torch.equal(key_cache.view(-1, 3, 64)[slots[written]], key[written].bfloat16())
    assert torch.equal(value_cache.view(-1, 3, 64)[slots[written]], value[written].bfloat16())


def test_cpu_path_without_the_c_kernel_matches_reference(monkeypatch):
    import kernels.write_kv as write_kv_module

    monkeypatch.setattr(write_kv_module, "_write_kv_kernel_cpu", lambda: None)
    for padding in (False, True):
        key, value, key_cache, value_cache, slots = make_inputs(11, 6, 4, 3, 64, torch.bfloat16, seed=4)
        if not padding:
            slots = torch.randperm(24)[:11]
        expected_k, expected_v = key_cache.clone(), value_cache.clone()
        write_kv_ref(key, value, expected_k, expected_v, slots)
        write_kv_cpu(key, value, key_cache, value_cache, slots)
        assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)


@pytest.mark.skipif(ON_CUDA, reason="the CPU path")
def test_cpu_path_rejects_a_slot_past_the_cache_and_writes_nothing():
    key, value, key_cache, value_cache, slots = make_inputs(5, 4, 4, 2, 64, torch.float32)
    slots = torch.tensor([0, 3, -1, 16, 2])  # 16 = 4 blocks x 4 slots: one past the end
    before_k, before_v = key_cache.clone(), value_cache.clone()
    with pytest.raises(IndexError):
        write_kv_cpu(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, before_k) and torch.equal(value_cache, before_v)
