"""Rotary embedding: the cos/sin table, the reference against rotate_half as Hugging Face
writes it, and the Triton kernel against the reference (in place, strided q/k)."""

import pytest
import torch

from kernels.rotary import (
    _rotary_kernel_cpu,
    compute_cos_sin_cache,
    rotary_embedding_cpu,
    rotary_embedding_ref,
    rotary_embedding_triton,
)

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
# (num_tokens, num_heads, num_kv_heads, head_dim)
SHAPES = (
    [(1, 32, 8, 128), (257, 32, 8, 128), (100, 9, 3, 64)]
    if ON_CUDA
    else [(1, 4, 2, 128), (7, 9, 3, 64), (5, 8, 1, 128)]
)
TOLERANCES = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
MAX_POSITION = 4096


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def make_qkv(num_tokens, num_heads, num_kv_heads, head_dim, dtype, seed=0):
    """positions, and q, k as column slices of one fused qkv tensor (non-contiguous)."""
    gen = torch.Generator().manual_seed(seed)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=gen).to(DEVICE, dtype)
    q = qkv[:, : num_heads * head_dim]
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim]
    positions = torch.randint(0, MAX_POSITION, (num_tokens,), generator=gen).to(DEVICE)
    return positions, qkv, q, k


def test_cos_sin_cache_layout():
    cache = compute_cos_sin_cache(64, 100, 10000.0)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    angles = torch.arange(100, dtype=torch.float64)[:, None] * inv_freq
    assert cache.shape == (100, 64) and cache.dtype == torch.float32
    torch.testing.assert_close(cache[:, :32].double(), angles.cos(), rtol=0, atol=2e-5)
    torch.testing.assert_close(cache[:, 32:].double(), angles.sin(), rtol=0, atol=2e-5)


def test_cos_sin_cache_takes_inv_freq():
    inv_freq = torch.rand(16)
    cache = compute_cos_sin_cache(32, 10, 10000.0, inv_freq=inv_freq)
    torch.testing.assert_close(cache[7, :16], torch.cos(7 * inv_freq))
    torch.testing.assert_close(cache[7, 16:], torch.sin(7 * inv_freq))


@pytest.mark.parametrize("shape", SHAPES)
def test_reference_matches_rotate_half(shape):
    num_tokens, num_heads, num_kv_heads, head_dim = shape
    positions, _, q, k = make_qkv(*shape, torch.float32)
    cache = compute_cos_sin_cache(head_dim, MAX_POSITION, 10000.0).to(DEVICE)
    cos = cache[positions, : head_dim // 2].repeat(1, 2)[:, None]
    sin = cache[positions, head_dim // 2 :].repeat(1, 2)[:, None]
    q3, k3 = q.unflatten(-1, (-1, head_dim)), k.unflatten(-1, (-1, head_dim))
    expected_q = q3 * cos + rotate_half(q3) * sin
    expected_k = k3 * cos + rotate_half(k3) * sin
    assert rotary_embedding_ref(positions, q, k, cache, head_dim) is None
    torch.testing.assert_close(q3, expected_q, rtol=0, atol=0)
    torch.testing.assert_close(k3, expected_k, rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", list(TOLERANCES))
def test_triton_matches_reference(shape, dtype):
    head_dim = shape[-1]
    cache = compute_cos_sin_cache(head_dim, MAX_POSITION, 500000.0).to(DEVICE)
    positions, qkv, q, k = make_qkv(*shape, dtype)
    expected_qkv = qkv.clone()
    num_q = q.shape[1]
    rotary_embedding_ref(
        positions, expected_qkv[:, :num_q], expected_qkv[:, num_q : num_q + k.shape[1]],
        cache, head_dim,
    )  # fmt: skip
    assert rotary_embedding_triton(positions, q, k, cache, head_dim) is None
    tol = TOLERANCES[dtype]
    # The whole fused tensor: q and k rotated, v untouched.
    torch.testing.assert_close(qkv, expected_qkv, rtol=tol, atol=tol)


@pytest.mark.cuda
def test_triton_takes_three_dim_heads():
    positions, _, q, k = make_qkv(6, 4, 2, 64, torch.float32)
    cache = compute_cos_sin_cache(64, MAX_POSITION, 10000.0).to(DEVICE)
    q3, k3 = q.unflatten(-1, (-1, 64)), k.unflatten(-1, (-1, 64))
    expected_q, expected_k = q3.clone(), k3.clone()
    rotary_embedding_ref(positions, expected_q, expected_k, cache, 64)
    rotary_embedding_triton(positions, q3, k3, cache, 64)
    torch.testing.assert_close(q3, expected_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k3, expected_k, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(_rotary_kernel_cpu(torch.float32) is None, reason="no C compiler: the C kernel cannot be built here")
@pytest.mark.parametrize("shape", [(1, 4, 2, 128), (7, 9, 3, 64), (300, 9, 3, 64), (5, 6, 2, 80)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_path_equals_reference_bit_for_bit(shape, dtype, cpu_isa):
    # Strided q and k (slices of a fused qkv), 300 tokens split among threads.
    num_tokens, num_heads, num_kv_heads, head_dim = shape
    positions, qkv, q, k = make_qkv(*shape, dtype, seed=num_tokens)
    cache = compute_cos_sin_cache(head_dim, MAX_POSITION, 10000.0)
    expected = qkv.clone()
    exp_q, exp_k = expected[:, : q.shape[1]], expected[:, q.shape[1] : q.shape[1] + k.shape[1]]
    rotary_embedding_ref(positions, exp_q, exp_k, cache, head_dim)
    assert rotary_embedding_cpu(positions, q, k, cache, head_dim) is None
    assert torch.equal(qkv, expected)  # v untouched, q and k rotated exactly alike


def test_cpu_path_rejects_positions_outside_the_table():
    positions, _, q, k = make_qkv(3, 4, 2, 64, torch.float32)
    cache = compute_cos_sin_cache(64, 16, 10000.0)
    with pytest.raises(IndexError):
        rotary_embedding_cpu(positions + 16, q, k, cache, 64)
