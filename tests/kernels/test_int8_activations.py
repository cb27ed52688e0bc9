"""Quantized-weight products with int8 activations: the C kernel (each instruction-set build
this host can run: AVX512_VNNI and AVX2) against the PyTorch reference.

Tolerances: the activations' quantization is the same bit for bit (tested alone), and the
per-block integer dot products are exact on both sides, so the results differ only in how
the float32 per-block terms (d_a * d_w * dot + s_a * offset, K / 32 of them) are rounded and
added (the reference sums them in float64): within 1e-5 of the product's magnitude
|x| @ |w|.T (what cancels in the sum still rounds), + 1e-5 absolute.
"""

import pytest
import torch

from kernels import int8_activations as ia
from kernels import quant_linear as ql
from kernels.cpu_build import load_library

ATOL, RTOL = 1e-4, 1e-5  # for results of magnitude ~1 (bfloat16: 1e-2 each)


def assert_close_to_reference(got, want, x, w):
    """|got - want| <= 1e-5 (1 + |x| @ |w|.T), w the exactly dequantized weight."""
    bound = 1e-5 * (1 + x.abs().float() @ w.abs().T)
    assert ((got.float() - want.float()).abs() <= bound).all(), (got.float() - want.float()).abs().max()

needs_kernel = pytest.mark.skipif(load_library("int8_activation_linear") is None, reason="no C compiler")


def int4_weight(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    scales = (torch.rand(n, k // 32, generator=g) * 0.2).half().float()
    offsets = (-8 * scales + 0.01 * torch.randn(n, k // 32, generator=g)).half().float()
    return packed, scales, offsets


def int8_weight(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    scales = (torch.rand(n, k // 32, generator=g) / 64).half().float()
    return q, scales


def activations(m, k, seed=0):
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[0, 32:64] = 0  # an all-zero block: scale 0, codes 0
    if m > 1:
        x[1, :32] *= 1e4  # one block far larger than the rest of its row
    return x


def test_reference_quantization_is_the_block_formula():
    x = torch.zeros(1, 64)
    x[0, :4] = torch.tensor([2.0, -1.0, 0.5, 1.0 / 127])
    q, d, s = ia.quantize_activations_ref(x)
    assert d[0, 0] == torch.tensor(2.0) / 127 and d[0, 1] == 0
    # x / d = [127, -63.5, 31.75, 0.5]: -63.5 rounds to even (-64), 0.5 to 0.
    assert q[0, :5].tolist() == [127, -64, 32, 0, 0]
    assert q[0, 32:].abs().sum() == 0
    assert s[0, 0] == d[0, 0] * (127 - 64 + 32)


@pytest.mark.parametrize("bits", [4, 8])
def test_reference_is_close_to_the_exact_product(bits):
    """The reference's algebra (offsets, int8's +128 codes) is the exact product's, up to
    the activations' rounding (~0.4% of a block's largest value per element)."""
    x = torch.randn(5, 576)
    if bits == 4:
        w = int4_weight(40, 576)
        got, exact = ia.int4_linear_ref(x, *w), ql.int4_linear_ref(x, *w)
    else:
        w = int8_weight(40, 576)
        got, exact = ia.int8_linear_ref(x, *w), ql.int8_linear_ref(x, *w)
    assert (got - exact).norm() / exact.norm() < 0.01


@needs_kernel
@pytest.mark.parametrize("m,k", [(1, 64), (5, 576), (33, 1536)])
def test_cpu_quantization_is_the_reference_bit_for_bit(m, k, cpu_isa):
    x = activations(m, k)
    for got, want in zip(ia.quantize_activations_cpu(x), ia.quantize_activations_ref(x)):
        assert torch.equal(got, want)


@needs_kernel
@pytest.mark.parametrize("m", [1, 2, 7, 8, 9, 32, 130])
@pytest.mark.parametrize("n,k", [(7, 64), (577, 576), (66, 1536)])
def test_cpu_products_match_the_reference(m, n, k, cpu_isa):
    assert ia.available()
    x = activations(m, k, seed=m)
    w4 = int4_weight(n, k, seed=m)
    assert_close_to_reference(ia.int4_linear_cpu(x, *w4), ia.int4_linear_ref(x, *w4), x, ql.dequantize_int4_ref(*w4))
    w8 = int8_weight(n, k, seed=m)
    assert_close_to_reference(ia.int8_linear_cpu(x, *w8), ia.int8_linear_ref(x, *w8), x, ql.dequantize_int8_ref(*w8))


@needs_kernel
def test_cpu_products_take_extreme_weight_codes(cpu_isa):
    """int8 -128 and 127 beside activation codes +-127 (AVX2's vpmaddubsw saturates int16:
    the kernel must keep every pair sum below it) and int4 15 everywhere."""
    k = 128
    x = torch.full((3, k), 1.0)
    x[1] = -1.0
    x[2, ::2] = -1.0
    q = torch.full((5, k), -128, dtype=torch.int8)
    q[1] = 127
    q[2, ::2] = 127
    scales = torch.full((5, k // 32), 0.5)
    torch.testing.assert_close(ia.int8_linear_cpu(x, q, scales), ia.int8_linear_ref(x, q, scales), atol=ATOL, rtol=RTOL)
    packed = torch.full((5, k // 2), 255, dtype=torch.uint8)
    torch.testing.assert_close(ia.int4_linear_cpu(x, packed, scales, -scales), ia.int4_linear_ref(x, packed, scales, -scales),
                               atol=ATOL, rtol=RTOL)


@needs_kernel
def test_cpu_products_read_strided_rows_and_keep_bfloat16(cpu_isa):
    x = torch.randn(6, 2 * 128)[:, :128]  # rows with stride 256
    w = int4_weight(33, 128)
    torch.testing.assert_close(ia.int4_linear_cpu(x, *w), ia.int4_linear_ref(x, *w), atol=ATOL, rtol=RTOL)
    xb = x.to(torch.bfloat16)
    got = ia.int4_linear_cpu(xb, *w)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, ia.int4_linear_ref(xb, *w), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("scale_bytes", [2, 4])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n", [32, 37])
def test_repacked_tiles_unpack_to_the_weight(n, bits, scale_bytes):
    w = int4_weight(n, 96) if bits == 4 else int8_weight(n, 96)
    tiles = ia.repack_tiles(*w, scale_bytes=scale_bytes)
    # Per column and block of 32: the codes, then a scale (and an offset) of scale_bytes:
    # with float16 ones, GGUF's Q4_1 (20 bytes) and Q8_0 (34).
    row_bytes = 96 * bits // 8 + (len(w) - 1) * scale_bytes * 96 // 32
    assert tiles.shape == (n, 96) and tiles.bits == bits and tiles.scale_bytes == scale_bytes
    assert tiles.nbytes() == -(-n // ia.TILE_N) * ia.TILE_N * row_bytes
    for got, want in zip(ia.unpack_tiles(tiles), w):
        assert torch.equal(got, want)
    rows = torch.tensor([n - 1, 0, 17, 17, 5])  # the embedding's lookups: any order, repeats
    for got, want in zip(ia.unpack_tiles(tiles, rows), w):
        assert torch.equal(got, want[rows])


@pytest.mark.parametrize("bits", [4, 8])
def test_tiles_keep_float16_scales_only_where_that_changes_no_value(bits):
    w = int4_weight(40, 64) if bits == 4 else int8_weight(40, 64)
    if ia.half_scales_available():
        assert ia.repack_tiles(*w).scale_bytes == 2  # GGUF's float16 scales (and offsets)
    exact_scales_only = (w[0], w[1], w[2] + 1e-4) if bits == 4 else (w[0], w[1] + 1e-4)
    assert ia.repack_tiles(*exact_scales_only).scale_bytes == 4
    with pytest.raises(ValueError, match="scale_bytes"):
        ia.repack_tiles(*w, scale_bytes=3)


@needs_kernel
@pytest.mark.parametrize("scale_bytes", [2, 4])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [1, 2, 4, 8, 33, 70])
@pytest.mark.parametrize("n,k", [(7, 64), (577, 576), (66, 1536)])
def test_cpu_products_of_repacked_tiles_match_the_reference_and_the_gather(m, n, k, bits, scale_bytes, cpu_isa):
    """Both builds read the tiles, with float32 or float16 scales (the same arithmetic as
    after their per-call gather: equal bit for bit); VNNI products only in the AVX-512 build;
    a row's result is its own, with others or alone."""
    assert ia.tiles_available()
    if cpu_isa == "avx2":
        assert not ia.vnni_available()
    if scale_bytes == 2 and not ia.half_scales_available():
        pytest.skip("this CPU has no F16C: its AVX2 build reads float32 scales only")
    x = activations(m, k, seed=m)
    if bits == 4:
        w, dense, reference, gathered = int4_weight(n, k, seed=m), ql.dequantize_int4_ref, ia.int4_linear_ref, ia.int4_linear_cpu
    else:
        w, dense, reference, gathered = int8_weight(n, k, seed=m), ql.dequantize_int8_ref, ia.int8_linear_ref, ia.int8_linear_cpu
    tiles = ia.repack_tiles(*w, scale_bytes=scale_bytes)
    got = ia.tiled_linear_cpu(x, tiles)
    assert_close_to_reference(got, reference(x, *w), x, dense(*w))
    assert torch.equal(got, gathered(x, *w))
    if m == 70:  # each row as a product of that row alone gives it
        assert all(torch.equal(got[i:i + 1], ia.tiled_linear_cpu(x[i:i + 1], tiles)) for i in (0, 37, 69))


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [1, 3, 8, 19])
@pytest.mark.parametrize("n", [16, 37])
def test_bfloat16_rows_in_and_out_are_the_float32_products_rounded_once(m, n, bits, cpu_isa):
    """bfloat16 rows go in as they are and the result comes out in bfloat16: the float32
    product of the widened rows, rounded to nearest even as ``.to`` rounds, bit for bit
    (repacked and gathered weights; rows of unit stride and strided ones)."""
    k = 128
    w = int4_weight(n, k, seed=m) if bits == 4 else int8_weight(n, k, seed=m)
    gathered = ia.int4_linear_cpu if bits == 4 else ia.int8_linear_cpu
    tiles = ia.repack_tiles(*w)
    wide = activations(m, 2 * k, seed=m)
    wide[:, 5] = 0.0078125 * 3  # values whose products land on rounding ties more often
    for x in (wide[:, :k].to(torch.bfloat16).contiguous(), wide.to(torch.bfloat16)[:, k:]):
        want = gathered(x.float(), *w).to(torch.bfloat16)
        for got in (ia.tiled_linear_cpu(x, tiles), gathered(x, *w)):
            assert got.dtype == torch.bfloat16
            assert torch.equal(got.view(torch.int16), want.view(torch.int16))
        widened = ia.tiled_linear_cpu(x, tiles, widened=True)  # the LM head's logits
        assert widened.dtype == torch.float32 and torch.equal(widened, want.float())


@needs_kernel
def test_bfloat16_results_round_ties_to_even(cpu_isa):
    """Products that are exact integers of 9 to 10 bits (every odd one a tie for bfloat16's
    8 bits): rounded as PyTorch's ``.to`` rounds them."""
    k, n = 64, 48
    x = torch.ones(40, k)
    x[:, 0] = x[:, 32] = 127  # each block's scale exactly 1: its codes are x
    x[:, 1] = torch.arange(40) - 20.0
    q = torch.randint(-4, 5, (n, k), dtype=torch.int8, generator=torch.Generator().manual_seed(0))
    scales = torch.ones(n, k // 32)
    exact = ia.int8_linear_cpu(x, q, scales)
    assert torch.equal(exact, x @ q.float().T)
    assert (exact.abs() > 256).sum() > 100 and (exact.remainder(2) == 1).sum() > 100
    want = exact.to(torch.bfloat16).view(torch.int16)
    tiles = ia.repack_tiles(q, scales)
    for got in (ia.tiled_linear_cpu(x.bfloat16(), tiles), ia.int8_linear_cpu(x.bfloat16(), q, scales),
                ia.tiled_linear_cpu(x.bfloat16(), tiles, widened=True).bfloat16()):
        assert torch.equal(got.view(torch.int16), want)
