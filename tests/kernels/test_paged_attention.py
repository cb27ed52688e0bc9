"""Paged attention: the Triton kernel against the PyTorch reference on ragged mixed
prefill/decode batches."""

import pytest
import torch

from kernels.paged_attention import paged_attention_triton
from kernels.paged_attention_torch import paged_attention_ref
from tests.kernels.paged_batch import HEAD_CONFIGS, ON_CUDA, make_batch, mixed_lens, poisoned_out

pytestmark = pytest.mark.cuda

# Under TRITON_INTERPRET=1, tl.dot on bf16 reinterprets the bits (numpy has no bf16), so bf16
# runs only on CUDA; fp16 covers the half-precision path on CPU.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_CUDA else [])
TOLERANCES = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("num_heads,num_kv_heads", HEAD_CONFIGS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_matches_reference(num_heads, num_kv_heads, head_dim, dtype):
    query_lens, context_lens = mixed_lens(seed=head_dim + num_kv_heads)
    batch = make_batch(
        query_lens, context_lens, num_heads, num_kv_heads, head_dim, dtype=dtype, seed=4
    )
    expected = paged_attention_ref(*batch.args())
    out = paged_attention_triton(*batch.args(), out=poisoned_out(batch.query))
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("block_size", [8, 16])
def test_triton_decode_only_batch(block_size):
    context_lens = [0, 7, 8, 9, 100] if not ON_CUDA else list(range(0, 4096, 61))
    batch = make_batch([1] * len(context_lens), context_lens, 8, 1, 128, block_size, seed=5)
    expected = paged_attention_ref(*batch.args())
    out = paged_attention_triton(*batch.args(), out=poisoned_out(batch.query))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_a_decode_tile_the_gpu_cannot_hold_falls_back_to_64_keys_once(monkeypatch):
    # A GPU with less shared memory than the H200 the 128-key decode tile was measured on
    # raises OutOfResources at its first launch: the call falls back and remembers.
    import kernels.paged_attention as pa
    from kernels.triton_import import OutOfResources

    tiles = []

    class SmallGPU:
        def __getitem__(self, grid):
            def launch(*args, BLOCK_N, **kwargs):
                tiles.append(BLOCK_N)
                if BLOCK_N > 64:
                    raise OutOfResources(196608, 101376, "shared memory")
                return real[grid](*args, BLOCK_N=BLOCK_N, **kwargs)
            return launch

    real = pa._paged_attention_kernel
    monkeypatch.setattr(pa, "_paged_attention_kernel", SmallGPU())
    monkeypatch.setattr(pa, "_DECODE_TILE_TOO_BIG", set())
    batch = make_batch([1, 1, 1], [0, 9, 100], 8, 2, 128, seed=12)
    expected = paged_attention_ref(*batch.args())
    for _ in range(2):
        out = paged_attention_triton(*batch.args(), out=poisoned_out(batch.query))
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert tiles == [128, 64, 64]
    assert pa._DECODE_TILE_TOO_BIG == {(128, batch.query.dtype)}
    with pytest.raises(OutOfResources):  # a tile asked for is not replaced
        paged_attention_triton(*batch.args(), block_n=128)


def test_triton_returns_new_tensor_in_query_dtype():
    batch = make_batch([3, 1], [0, 5], 2, 2, 64, dtype=torch.float16, seed=6)
    out = paged_attention_triton(*batch.args())
    assert out.shape == batch.query.shape and out.dtype == torch.float16
    torch.testing.assert_close(out, paged_attention_ref(*batch.args()), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("num_splits", [2, 4])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEAD_CONFIGS[1:])
def test_triton_split_kv_matches_reference(num_splits, num_heads, num_kv_heads):
    # Decodes, plus a chunk with context: some splits see no key for its early rows.
    context_lens = [0, 3, 70, 129, 40] if not ON_CUDA else [0, 3, 700, 4000, 1200]
    query_lens = [1, 1, 1, 1, 17]
    batch = make_batch(query_lens, context_lens, num_heads, num_kv_heads, 64, seed=7)
    expected = paged_attention_ref(*batch.args())
    out = paged_attention_triton(
        *batch.args(), out=poisoned_out(batch.query), num_splits=num_splits
    )
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_triton_head_dim_not_power_of_two(num_splits):
    batch = make_batch([1, 6, 1], [20, 9, 0], 4, 2, 80, seed=8)
    expected = paged_attention_ref(*batch.args())
    out = paged_attention_triton(
        *batch.args(), out=poisoned_out(batch.query), num_splits=num_splits
    )
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [5, 16, 70, 1000])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_triton_with_a_sliding_window_matches_dense_attention(window, num_splits):
    # The blocks wholly before each request's window hold garbage (out-of-range) ids: the
    # kernel must neither read nor load them; windows narrower than a tile, a tile, wider.
    from tests.kernels.paged_batch import dense_attention

    query_lens, context_lens = mixed_lens(seed=window)
    batch = make_batch(query_lens, context_lens, 6, 2, 64, block_size=8, seed=9, window=window)
    out = paged_attention_triton(*batch.args(), out=poisoned_out(batch.query), num_splits=num_splits)
    torch.testing.assert_close(out.double(), dense_attention(batch), rtol=1e-5, atol=1e-5)
    decodes = make_batch([1] * 5, [0, 15, 16, 17, 200], 8, 1, 128, block_size=16, seed=10, window=window)
    out = paged_attention_triton(*decodes.args(), out=poisoned_out(decodes.query), num_splits=num_splits)
    torch.testing.assert_close(out.double(), dense_attention(decodes), rtol=1e-5, atol=1e-5)
