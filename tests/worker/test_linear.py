"""The worker's weight products: oneDNN-prepacked against ``F.linear``."""

import pytest
import torch
from torch import nn

from services.worker.linear import can_prepack, plain_linear, prepacked_linear

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
