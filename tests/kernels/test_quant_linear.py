"""Weight-only int8 / int4 products: the C kernels (CPU) and the Triton kernel (CUDA, or its
interpreter here) against the PyTorch references (dequantize, then ``F.linear``).

Tolerances: the kernels add the same float32 products as the reference in another order,
so with unit-scale activations and weights (|w| <= ~3) and K <= 1536 a result is within
1e-4 absolute + 1e-5 relative of the reference's; the dequantized values themselves are
equal bit for bit (scales and offsets are float16 values, as in GGUF).
"""

import pytest
import torch

from kernels import quant_linear as ql
from kernels.cpu_build import load_library

ON_CUDA = torch.cuda.is_available()
ATOL, RTOL = 1e-4, 1e-5


def int4_weight(n, k, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    scales = (torch.rand(n, k // 32, generator=g) * 0.2).half().float()
    offsets = (-8 * scales + 0.01 * torch.randn(n, k // 32, generator=g)).half().float()
    return packed.to(device), scales.to(device), offsets.to(device)


def int8_weight(n, k, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    scales = (torch.rand(n, k // 32, generator=g) / 64).half().float()
    return q.to(device), scales.to(device)


def test_pack_and_unpack_int4_are_inverse_and_follow_q4_0s_nibble_order():
    q = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    packed = ql.pack_int4(q)
    assert torch.equal(ql.unpack_int4(packed), q)
    # Block 1, byte 5: element 32 + 5 in the low nibble, 32 + 16 + 5 in the high one.
    assert packed[2, 16 + 5] == q[2, 37] | (q[2, 53] << 4)


def test_references_are_the_block_formulas():
    packed, scales, offsets = int4_weight(4, 64)
    q = ql.unpack_int4(packed).float()
    w = ql.dequantize_int4_ref(packed, scales, offsets)
    assert torch.equal(w[1, 40], q[1, 40] * scales[1, 1] + offsets[1, 1])
    q8, s8 = int8_weight(4, 64)
    assert torch.equal(ql.dequantize_int8_ref(q8, s8)[3, 31], q8[3, 31].float() * s8[3, 0])


needs_kernel = pytest.mark.skipif(load_library("quant_linear") is None, reason="no C compiler")


@needs_kernel
@pytest.mark.parametrize("n,k", [(5, 64), (576, 576), (67, 1536)])
def test_cpu_dequantize_is_the_reference_bit_for_bit(n, k):
    packed, scales, offsets = int4_weight(n, k)
    assert torch.equal(ql.dequantize_int4_cpu(packed, scales, offsets), ql.dequantize_int4_ref(packed, scales, offsets))
    q, s = int8_weight(n, k)
    assert torch.equal(ql.dequantize_int8_cpu(q, s), ql.dequantize_int8_ref(q, s))


@needs_kernel
@pytest.mark.parametrize("m", [1, 3, 4, 8, 13, 32, ql.CPU_DEQUANT_GEMM_MIN_ROWS + 3])
@pytest.mark.parametrize("n,k", [(7, 64), (577, 576), (66, 1536)])
def test_cpu_products_match_the_references(m, n, k):
    x = torch.randn(m, k)
    packed, scales, offsets = int4_weight(n, k, seed=m)
    torch.testing.assert_close(ql.int4_linear_cpu(x, packed, scales, offsets),
                               ql.int4_linear_ref(x, packed, scales, offsets), atol=ATOL, rtol=RTOL)
    q, s = int8_weight(n, k, seed=m)
    torch.testing.assert_close(ql.int8_linear_cpu(x, q, s), ql.int8_linear_ref(x, q, s), atol=ATOL, rtol=RTOL)


@needs_kernel
def test_cpu_products_read_strided_rows_and_keep_bfloat16():
    x = torch.randn(6, 2 * 128)[:, :128]  # rows with stride 256
    packed, scales, offsets = int4_weight(33, 128)
    torch.testing.assert_close(ql.int4_linear_cpu(x, packed, scales, offsets),
                               ql.int4_linear_ref(x, packed, scales, offsets), atol=ATOL, rtol=RTOL)
    xb = x.to(torch.bfloat16)
    got = ql.int4_linear_cpu(xb, packed, scales, offsets)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, ql.int4_linear_ref(xb, packed, scales, offsets), atol=1e-2, rtol=1e-2)


# On a GPU also products over many tiles: a decode batch and a prompt chunk of SmolLM2's MLP.
TRITON_SHAPES = [(1, 70, 64), (19, 64, 96)] + ([(32, 1536, 576), (300, 577, 1536)] if ON_CUDA else [])
# Half-precision activations: the kernel computes in float32 as the reference does, so the
# two results are the same half value except where their float32 sums straddle a rounding
# boundary (one unit in the last place).
HALF_TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


@pytest.mark.cuda
@pytest.mark.parametrize("m,n,k", TRITON_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_products_match_the_references(m, n, k, dtype):
    device = "cuda" if ON_CUDA else "cpu"
    x = torch.randn(m, k, device=device).to(dtype)
    atol, rtol = (ATOL, RTOL) if dtype == torch.float32 else (HALF_TOLERANCE[dtype], HALF_TOLERANCE[dtype])
    packed, scales, offsets = int4_weight(n, k, device=device)
    got = ql.int4_linear_triton(x, packed, scales, offsets)
    assert got.dtype == dtype
    torch.testing.assert_close(got, ql.int4_linear_ref(x, packed, scales, offsets), atol=atol, rtol=rtol)
    q, s = int8_weight(n, k, device=device)
    torch.testing.assert_close(ql.int8_linear_triton(x, q, s), ql.int8_linear_ref(x, q, s), atol=atol, rtol=rtol)


def test_pytorchs_int4pack_takes_a_q4_1_block_with_zero_min_plus_8_scales():
    """The mapping scripts/bench_quant.py --kernels measures PyTorch's int4 op with:
    tinygemm dequantizes (q - 8) * scale + zero, so a block's min m becomes zero = m + 8 scale."""
    packed, scales, offsets = int4_weight(64, 128)
    q = ql.unpack_int4(packed).int()
    zeros = torch.stack((scales, offsets + 8 * scales), dim=-1).transpose(0, 1).contiguous()
    x = torch.randn(3, 128)
    got = torch.ops.aten._weight_int4pack_mm_for_cpu(x, torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1),
                                                     32, zeros)
    torch.testing.assert_close(got, ql.int4_linear_ref(x, packed, scales, offsets), atol=ATOL, rtol=RTOL)
