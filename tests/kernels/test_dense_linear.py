"""The batch-invariant dense products (kernels/dense_linear.py) against the float64
reference, and a row's bits the same at any row count, place in the product and thread
count, in each build this host runs."""

import pytest
import torch

from kernels import dense_linear
from kernels.dense_linear import dense_linear_cpu, dense_linear_ref, repack

pytestmark = pytest.mark.skipif(not dense_linear.available(torch.float32), reason="no C compiler")

# (n, k): SmolLM2-135M's qkv, gate_up, down and a ragged one (n not a multiple of 16).
SHAPES = [(960, 576), (3072, 576), (576, 1536), (100, 64)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k", SHAPES)
def test_rows_get_the_same_bits_at_any_row_count_and_match_the_reference(dtype, n, k, cpu_isa):
    gen = torch.Generator().manual_seed(n + k)
    weight = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    tiles = repack(weight)
    x = torch.randn(203, k, generator=gen).to(dtype)
    alone = torch.cat([dense_linear_cpu(x[i:i + 1], tiles, bias) for i in range(x.shape[0])])
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(alone.double(), dense_linear_ref(x, weight, bias).double(), rtol=tolerance,
                               atol=tolerance)
    for rows in (2, 5, 6, 7, 13, 96, 97, 203):
        assert torch.equal(dense_linear_cpu(x[:rows], tiles, bias), alone[:rows]), rows
    assert torch.equal(dense_linear_cpu(x[50:61], tiles, bias), alone[50:61])  # another place, another tail
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(dense_linear_cpu(x, tiles, bias), alone)
    finally:
        torch.set_num_threads(threads)


def test_strided_rows_and_a_dtype_mismatch():
    weight = torch.randn(32, 64).to(torch.bfloat16)
    x = torch.randn(8, 128).to(torch.bfloat16)[:, :64]  # rows 128 apart
    assert torch.equal(dense_linear_cpu(x, repack(weight)), dense_linear_cpu(x.contiguous(), repack(weight)))
    with pytest.raises(TypeError):
        dense_linear_cpu(x.float(), repack(weight))
    assert not dense_linear.available(torch.bfloat16, k=63) and not dense_linear.available(torch.float16)
