"""SiLU-and-mul, the gated activation of the Llama MLP: silu(gate) * up.

The MLP's fused gate_up projection yields x [T, 2*I] = [gate | up]; this returns
[T, I]. `silu_and_mul_ref` is the PyTorch reference (fp32 math, rounded once);
`silu_and_mul_cpu` is the CPU path: bf16 rows through `kernels/cpu/silu_and_mul.c` (float32
math rounded once, like the reference, in one pass); float32, and bf16 where no C kernel
can be built, as Hugging Face's LlamaMLP ops in the tensor's own dtype (for fp32 the
reference's result bit for bit; for bf16 one rounding more, as HF's bf16 model rounds);
`silu_and_mul_cpu_c` takes the C kernel for float32 rows too (one pass instead of three;
its exp moves the last bit of some outputs), for models that need no bit-for-bit parity
with Hugging Face; `silu_and_mul_triton` is the GPU kernel: a 2-D grid over (token, column block), in fp32.
"""

import ctypes

import torch
import torch.nn.functional as F

from kernels.cpu_build import bind, kernel_binding
from kernels.triton_import import tl, triton

_SILU_AND_MUL_ARGS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int]


@kernel_binding
def _silu_and_mul_kernel_cpu():
    return bind("silu_and_mul", "silu_and_mul_bf16", _SILU_AND_MUL_ARGS)


@kernel_binding
def _silu_and_mul_f32_kernel_cpu():
    return bind("silu_and_mul", "silu_and_mul_f32", _SILU_AND_MUL_ARGS)


# silu_and_mul_cpu_c's kernel for each dtype.
_C_KERNELS = {torch.bfloat16: _silu_and_mul_kernel_cpu, torch.float32: _silu_and_mul_f32_kernel_cpu}


def silu_and_mul_cpu(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, 2*I] -> silu(x[:, :I]) * x[:, I:] in x's dtype (the reference's result for fp32)."""
    kernel = _silu_and_mul_kernel_cpu() if x.dtype == torch.bfloat16 and x.device.type == "cpu" else None
    return _silu_and_mul_c(kernel, x, out)


def silu_and_mul_cpu_c(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """`silu_and_mul_cpu`, with float32 rows through the C kernel as well."""
    binding = _C_KERNELS.get(x.dtype) if x.device.type == "cpu" else None
    return _silu_and_mul_c(binding() if binding else None, x, out)


def _silu_and_mul_c(kernel, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """Through `kernel` (for x's dtype) where it and the tensors allow, else Hugging Face's ops."""
    if kernel is not None and x.dim() == 2 and x.stride(1) == 1 and x.shape[1] % 2 == 0:
        rows, inter = x.shape[0], x.shape[1] // 2
        if out is None:
            out = torch.empty((rows, inter), dtype=x.dtype)
        if out.dtype == x.dtype and out.shape == (rows, inter) and out.stride(1) == 1 and out.device.type == "cpu":
            kernel(x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), rows, inter, torch.get_num_threads())
            return out
    gate, up = x.chunk(2, dim=-1)
    return torch.mul(F.silu(gate), up, out=out)


def silu_and_mul_ref(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, 2*I] -> silu(x[:, :I]) * x[:, I:]; fp16/bf16 go through fp32, rounded once.

    `out`, if given, is a preallocated [T, I] tensor the result is written into.
    """
    gate, up = x.chunk(2, dim=-1)
    if x.dtype not in (torch.float16, torch.bfloat16):
        # fp32 is the CPU path: no casts, the same ops as Hugging Face's LlamaMLP.
        return torch.mul(F.silu(gate), up, out=out)
    result = (F.silu(gate.float()) * up.float()).to(x.dtype)
    return result if out is None else out.copy_(result)


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    x_stride,
    out_stride,
    intermediate_size,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = cols < intermediate_size
    gate = tl.load(x_ptr + token * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + token * x_stride + intermediate_size + cols, mask=mask, other=0.0)
    out = gate / (1.0 + tl.exp(-gate)) * up.to(tl.float32)
    tl.store(out_ptr + token * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def gated_activation_triton(kernel, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """Launch a gated activation's Triton ``kernel`` (this module's signature) on x [T, 2*I]."""
    assert x.dim() == 2 and x.stride(-1) == 1 and x.shape[-1] % 2 == 0
    num_tokens, intermediate_size = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty((num_tokens, intermediate_size), dtype=x.dtype, device=x.device)
    assert out.shape == (num_tokens, intermediate_size) and out.stride(-1) == 1
    if num_tokens > 0:
        block_size = min(triton.next_power_of_2(intermediate_size), 1024)
        grid = (num_tokens, triton.cdiv(intermediate_size, block_size))
        kernel[grid](x, out, x.stride(0), out.stride(0), intermediate_size, BLOCK_SIZE=block_size)
    return out


def silu_and_mul_triton(x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton SiLU-and-mul of x [T, 2*I] -> [T, I]."""
    return gated_activation_triton(_silu_and_mul_kernel, x, out)
