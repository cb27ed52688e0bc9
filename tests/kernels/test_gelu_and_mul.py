"""GELU(tanh)-and-mul, Gemma's gated activation: the reference is Hugging Face's
``gelu_pytorch_tanh(gate) * up``, and the Triton kernel matches it."""

import pytest
import torch
from transformers.activations import ACT2FN

from kernels.gelu_and_mul import gelu_tanh_and_mul_ref, gelu_tanh_and_mul_triton
from tests.kernels.paged_batch import DEVICE


def test_reference_is_hugging_faces_activation_bit_for_bit():
    x = torch.randn(7, 2 * 96) * 4
    gate, up = x.chunk(2, dim=-1)
    assert torch.equal(gelu_tanh_and_mul_ref(x), ACT2FN["gelu_pytorch_tanh"](gate) * up)


@pytest.mark.parametrize("rows,inter", [(1, 64), (13, 2048), (5, 100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_matches_the_reference(rows, inter, dtype):
    x = (torch.randn(rows, 2 * inter) * 6).to(DEVICE, dtype)  # large gates: tanh saturates without overflow
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(gelu_tanh_and_mul_triton(x), gelu_tanh_and_mul_ref(x), rtol=tol, atol=tol)
