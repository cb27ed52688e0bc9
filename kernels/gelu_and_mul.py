"""GELU(tanh)-and-mul, the gated activation of Gemma's MLP: gelu_tanh(gate) * up.

The MLP's fused gate_up projection yields x [T, 2*I] = [gate | up]; this returns [T, I].
`gelu_tanh_and_mul_ref` is the PyTorch reference and the CPU path: Hugging Face's
operations (``gelu_pytorch_tanh(gate) * up``) in the tensor's dtype, so float32 results
are Hugging Face's bit for bit; fp16/bf16 in float32, rounded once.
`gelu_tanh_and_mul_triton` is the GPU kernel: a 2-D grid over (token, column block), in
float32.
"""

import torch
import torch.nn.functional as F

from kernels.silu_and_mul import gated_activation_triton
from kernels.triton_import import tl, triton


def gelu_tanh_and_mul_ref(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, 2*I] -> gelu_tanh(x[:, :I]) * x[:, I:]."""
    gate, up = x.chunk(2, dim=-1)
    if x.dtype not in (torch.float16, torch.bfloat16):
        return torch.mul(F.gelu(gate, approximate="tanh"), up, out=out)
    result = (F.gelu(gate.float(), approximate="tanh") * up.float()).to(x.dtype)
    return result if out is None else out.copy_(result)


@triton.jit
def _gelu_tanh_and_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, intermediate_size, BLOCK_SIZE: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = cols < intermediate_size
    gate = tl.load(x_ptr + token * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + token * x_stride + intermediate_size + cols, mask=mask, other=0.0).to(tl.float32)
    inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)  # sqrt(2 / pi) * (...)
    # tanh(z) = 1 - 2 / (exp(2z) + 1): finite for every z (exp overflowing to inf gives 1).
    tanh = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)
    out = 0.5 * gate * (1.0 + tanh) * up
    tl.store(out_ptr + token * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def gelu_tanh_and_mul_triton(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton GELU(tanh)-and-mul of x [T, 2*I] -> [T, I]."""
    return gated_activation_triton(_gelu_tanh_and_mul_kernel, x, out)
