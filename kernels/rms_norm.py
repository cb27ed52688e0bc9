"""RMSNorm, optionally fused with the residual add before it.

Used by every decoder layer twice (input and post-attention norms) and once at the end of
the model. `rms_norm_ref` is the PyTorch reference; `rms_norm_cpu` the CPU path (bfloat16
rows through `kernels/cpu/rms_norm.c`, one call instead of eight small tensor ops; float32
through `torch.nn.functional.rms_norm`, whose CPU form runs Hugging Face's operations in
Hugging Face's order, so it matches the reference bit for bit, in one dispatch and with
fewer temporaries); `rms_norm_cpu_c` takes the C kernel for float32 rows too (a few times
faster; its vectorized sum of squares moves the last bit of some outputs), for models that
need no bit-for-bit parity with Hugging Face; `rms_norm_triton` is the GPU kernel: one
program per token row, the whole hidden size in one block.
"""

import ctypes

import torch
import torch.nn.functional as F

from kernels.cpu_build import bind, kernel_binding
from kernels.triton_import import tl, triton


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> x / sqrt(mean(x^2) + eps) * weight; with residual, returns (out, x + residual).

    `out`, if given, is a preallocated [T, H] tensor the result is written into.
    """
    if residual is not None:
        residual = x + residual
        x = residual
    xf = x.float()
    variance = xf.pow(2).mean(-1, keepdim=True)
    # Same operation order as Hugging Face's LlamaRMSNorm, so fp32 results match bit for bit.
    normed = (weight.float() * (xf * torch.rsqrt(variance + eps))).to(x.dtype)
    out = normed if out is None else out.copy_(normed)
    return out if residual is None else (out, residual)


_C = ctypes.c_void_p, ctypes.c_int64
_RMS_NORM_ARGS = [*_C, *_C, ctypes.c_void_p, *_C, ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_int]


@kernel_binding
def _rms_norm_kernel_cpu():
    return bind("rms_norm", "rms_norm_bf16", _RMS_NORM_ARGS)


@kernel_binding
def _rms_norm_f32_kernel_cpu():
    return bind("rms_norm", "rms_norm_f32", _RMS_NORM_ARGS)


# rms_norm_cpu_c's kernel for each dtype.
_C_KERNELS = {torch.bfloat16: _rms_norm_kernel_cpu, torch.float32: _rms_norm_f32_kernel_cpu}


def rms_norm_cpu(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm_ref`'s result; for bfloat16 rows through the C kernel, which (like the
    Triton kernel) writes the sum x + residual into `residual` in place."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32 and out is None and x.device.type == "cpu":
        if residual is not None:
            residual = x + residual
            x = residual
        normed = F.rms_norm(x, (x.shape[-1],), weight, eps)
        return normed if residual is None else (normed, residual)
    return _rms_norm_c(_rms_norm_kernel_cpu() if x.dtype == torch.bfloat16 else None, x, weight, eps, residual, out)


def rms_norm_cpu_c(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm_cpu`, with float32 rows through the C kernel as well (the sum x + residual
    written into `residual` in place, as for bfloat16)."""
    binding = _C_KERNELS.get(x.dtype)
    return _rms_norm_c(binding() if binding else None, x, weight, eps, residual, out)


def _rms_norm_c(kernel, x, weight, eps, residual, out):
    """Through `kernel` (for x's dtype) where it and the tensors allow, else the reference."""
    tensors = (x, weight) if residual is None else (x, weight, residual)
    if (
        kernel is None
        or x.dim() != 2
        or x.shape[1] > 16384
        or any(t.device.type != "cpu" or t.dtype != x.dtype or t.stride(-1) != 1 for t in tensors)
        or (residual is not None and residual.shape != x.shape)
        or (out is not None and (out.dtype != x.dtype or out.stride(-1) != 1 or out.shape != x.shape))
    ):
        return rms_norm_ref(x, weight, eps, residual, out=out)
    if out is None:
        out = torch.empty_like(x)
    rows, hidden = x.shape
    kernel(
        x.data_ptr(), x.stride(0),
        None if residual is None else residual.data_ptr(), 0 if residual is None else residual.stride(0),
        weight.data_ptr(), out.data_ptr(), out.stride(0), rows, hidden, eps, torch.get_num_threads(),
    )  # fmt: skip
    return out if residual is None else (out, residual)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    x_stride,
    residual_stride,
    out_stride,
    hidden_size,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # Added in fp32 (the interpreter mangles bf16 arithmetic) and rounded to the activation
        # dtype, as the unfused add would do.
        r = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_ptr + row * residual_stride + cols, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) / hidden_size
    rstd = 1.0 / tl.sqrt(variance + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = w * (xf * rstd)
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Triton RMSNorm; with residual, the sum x + residual is written into `residual` in place."""
    assert x.dim() == 2 and x.stride(-1) == 1, "x must be [T, H] with contiguous rows"
    num_tokens, hidden_size = x.shape
    if out is None:
        out = torch.empty_like(x)
    assert out.shape == x.shape and out.stride(-1) == 1
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(-1) == 1
    if num_tokens > 0:
        block_size = triton.next_power_of_2(hidden_size)
        _rms_norm_kernel[(num_tokens,)](
            x,
            residual if residual is not None else x,
            weight,
            out,
            x.stride(0),
            residual.stride(0) if residual is not None else 0,
            out.stride(0),
            hidden_size,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK_SIZE=block_size,
            num_warps=min(max(block_size // 256, 1), 8),
        )
    return out if residual is None else (out, residual)
