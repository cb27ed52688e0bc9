"""The worker's weight products: oneDNN-prepacked against ``F.linear``; which kernel a
quantized weight's CPU product runs by row count."""

import pytest
import torch
from torch import nn

from kernels import int8_activations, quant_linear
from services.worker import linear as worker_linear
from services.worker.linear import can_prepack, plain_linear, prepacked_linear, quantized_linear
from shared.gguf_quants import QuantizedTensor

DTYPES = [torch.float32] + ([torch.bfloat16] if can_prepack(torch.device("cpu"), torch.bfloat16) else [])


def test_plain_linear_reads_the_weight_at_call_time():
    module = nn.Module()
    module.w = nn.Parameter(torch.ones(3, 4), requires_grad=False)
    linear = plain_linear(module, "w")
    module.w.data = torch.full((3, 4), 2.0)
    torch.testing.assert_close(linear(torch.ones(2, 4)), torch.full((2, 3), 8.0))


@pytest.mark.skipif(not can_prepack(torch.device("cpu"), torch.float32), reason="PyTorch built without oneDNN")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 32, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_prepacked_matches_f_linear(dtype, rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=gen).to(dtype)
    bias = torch.randn(96, generator=gen).to(dtype) if with_bias else None
    x = torch.randn(rows, 80, generator=gen).to(dtype)
    got = prepacked_linear(weight, bias)(x)
    assert got.dtype == dtype and got.shape == (rows, 96)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, nn.functional.linear(x, weight, bias), rtol=tol, atol=tol)


def test_no_prepack_off_cpu_or_for_fp16():
    assert not can_prepack(torch.device("meta"), torch.float32)
    assert not can_prepack(torch.device("cpu"), torch.float16)


@pytest.mark.skipif(not int8_activations.available(), reason="no C compiler or no AVX2")
@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_cpu_products_take_int8_activations_from_their_row_count_on(bits):
    gen = torch.Generator().manual_seed(bits)
    scales = torch.rand(48, 4, generator=gen) / 16
    if bits == 4:
        weight = QuantizedTensor(4, torch.randint(0, 256, (48, 64), dtype=torch.uint8, generator=gen), scales, -8 * scales)
        exact, int8_activated = quant_linear.int4_linear_cpu, int8_activations.int4_linear_cpu
    else:
        weight = QuantizedTensor(8, torch.randint(-128, 128, (48, 128), dtype=torch.int8, generator=gen), scales)
        exact, int8_activated = quant_linear.int8_linear_cpu, int8_activations.int8_linear_cpu
    args = [t for t in (weight.data, weight.scales, weight.offsets) if t is not None]
    product = quantized_linear(weight)
    min_rows = worker_linear.int8_activations_min_rows()
    few, many = min_rows - 1, min_rows
    x_few, x_many = torch.randn(few, 128, generator=gen), torch.randn(many, 128, generator=gen)
    if few:
        assert torch.equal(product(x_few), exact(x_few, *args))
    assert torch.equal(product(x_many), int8_activated(x_many, *args))
    assert not torch.equal(int8_activated(x_many, *args), exact(x_many, *args))


@pytest.mark.skipif(not int8_activations.available(), reason="no C compiler or no AVX2")
def test_without_vnni_one_row_takes_int8_activations(monkeypatch):
    """Where the int8-activation kernel has no AVX512_VNNI (its AVX2 build), the exact
    kernel is the slower one even at 1 row, so every row count takes int8 activations."""
    monkeypatch.setattr(int8_activations, "vnni_available", lambda: False)
    gen = torch.Generator().manual_seed(1)
    scales = torch.rand(48, 4, generator=gen) / 16
    weight = QuantizedTensor(4, torch.randint(0, 256, (48, 64), dtype=torch.uint8, generator=gen), scales, -8 * scales)
    args = (weight.data, weight.scales, weight.offsets)
    x = torch.randn(1, 128, generator=gen)
    assert worker_linear.int8_activations_min_rows() == 1
    assert torch.equal(quantized_linear(weight)(x), int8_activations.int4_linear_cpu(x, *args))
    assert not torch.equal(int8_activations.int4_linear_cpu(x, *args), quant_linear.int4_linear_cpu(x, *args))


def _rows_alone_and_together(product, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat([product(x[i:i + 1]) for i in range(x.shape[0])]), product(x)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("int8_built", [True, False])
def test_batch_invariant_quantized_products_give_a_row_the_same_bits_at_any_row_count(bits, int8_built, monkeypatch):
    """A row-layout matrix (tiles not repacked) multiplied one row at a time and in products of
    1..200 rows (both sides of INT8_ACTIVATIONS_MIN_ROWS and of the exact kernel's GEMM
    switch): the same bits, with the int8-activation kernel or, where it is not built, the
    exact one."""
    if int8_built and not int8_activations.available():
        pytest.skip("no C compiler or no AVX2")
    if not int8_built:
        monkeypatch.setattr(int8_activations, "available", lambda: False)
    gen = torch.Generator().manual_seed(bits)
    scales = torch.rand(40, 6, generator=gen) / 16
    if bits == 4:
        weight = QuantizedTensor(4, torch.randint(0, 256, (40, 96), dtype=torch.uint8, generator=gen), scales, -8 * scales)
    else:
        weight = QuantizedTensor(8, torch.randint(-128, 128, (40, 192), dtype=torch.int8, generator=gen), scales)
    x = torch.randn(200, 192, generator=gen).to(torch.bfloat16)
    alone, together = _rows_alone_and_together(quantized_linear(weight, batch_invariant=True), x)
    assert torch.equal(alone, together)
    for rows in (2, 3, 5, 9, 130):
        assert torch.equal(quantized_linear(weight, batch_invariant=True)(x[:rows]), alone[:rows])


@pytest.mark.parametrize("repacked", [False, True])
def test_widened_products_are_the_rounded_result_as_float32(repacked):
    """The LM head's product (``widened``): ``.to(x.dtype).float()`` of the plain product,
    bit for bit, whether the kernel writes it at once (repacked tiles) or not."""
    gen = torch.Generator().manual_seed(3)
    scales = torch.rand(40, 4, generator=gen) / 16
    weight = QuantizedTensor(8, torch.randint(-128, 128, (40, 128), dtype=torch.int8, generator=gen), scales)
    if repacked:
        if not int8_activations.tiles_available():
            pytest.skip("no repacked tiles without the C kernel's vector builds")
        weight = worker_linear.cpu_layout(weight)
        assert isinstance(weight, int8_activations.WeightTiles)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(5, 128, generator=gen).to(dtype)
        got = quantized_linear(weight, widened=True)(x)
        assert got.dtype == torch.float32
        assert torch.equal(got, quantized_linear(weight)(x).float())
    with pytest.raises(ValueError):
        quantized_linear(weight, torch.zeros(40), widened=True)
