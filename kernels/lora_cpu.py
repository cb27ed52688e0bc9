"""The LoRA delta of a step's tokens under mixed adapters on CPU, in one C call per projection.

``add_lora_cpu(y, x, a_slots, b_slots, token_slot)`` adds ``B[s]^T A[s] x[t]`` to every row
``t`` whose slot ``s = token_slot[t]`` is not -1 (``kernels/cpu/lora.c``: punica's bgmv idea,
the tokens grouped by slot inside the kernel, each slot's rows of A and B read in place; no
padding, no per-adapter loop, no copy of the weights). float32 or bfloat16 (activations and
slots alike); h = A x stays float32 and each y row is rounded once. ``out_splits`` (the
widths of a fused projection's sub-modules) lets it skip the zero blocks of B
(``services/worker/lora/adapter.py`` lays B out block-diagonal). The PyTorch reference is
``services/worker/lora/batched.py``'s ``lora_delta_reference``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from kernels.cpu_build import bind, kernel_binding

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
# x, x_stride, a, b, slot, num_slots, y, y_stride, tokens, in, rank, out, blocks, col_splits, threads
_LORA_DELTA_ARGS = [_P, _I64, _P, _P, _P, _INT, _P, _I64, _INT, _INT, _INT, _INT, _INT, _P, _INT]
_SYMBOLS = {torch.float32: "lora_delta_f32", torch.bfloat16: "lora_delta_bf16"}


@kernel_binding
def _lora_delta_kernel(dtype: torch.dtype):
    return bind("lora", _SYMBOLS[dtype], _LORA_DELTA_ARGS, ctypes.c_int)


def lora_cpu_available(dtype: torch.dtype) -> bool:
    """Whether the C kernel can run for ``dtype`` here (a compiler, native kernels on)."""
    return dtype in _SYMBOLS and _lora_delta_kernel(dtype) is not None


def add_lora_cpu(y: torch.Tensor, x: torch.Tensor, a_slots: torch.Tensor, b_slots: torch.Tensor,
                 token_slot: torch.Tensor, out_splits: Sequence[int] | None = None) -> bool:
    """``y += delta`` in place; False (``y`` untouched) when the kernel cannot take these
    tensors (another dtype or device, strides, no compiler), so the caller runs another way.

    ``y`` ``[T, out]``, ``x`` ``[T, in]``, ``a_slots`` ``[S, R, in]``, ``b_slots`` ``[S, R, out]``,
    ``token_slot`` ``[T]`` int64 (-1: none)."""
    dtype = x.dtype
    num_slots, rank, in_features = a_slots.shape
    num_tokens, out_features = y.shape
    splits = list(out_splits) if out_splits is not None else [out_features]
    if (
        dtype not in _SYMBOLS
        or any(t.dtype != dtype or t.device.type != "cpu" for t in (y, a_slots, b_slots))
        or x.dim() != 2 or x.shape != (num_tokens, in_features) or x.stride(1) != 1 or y.stride(1) != 1
        or b_slots.shape != (num_slots, rank, out_features)
        or not (a_slots.is_contiguous() and b_slots.is_contiguous())
        or token_slot.dtype != torch.int64 or token_slot.device.type != "cpu" or token_slot.shape != (num_tokens,)
        or not token_slot.is_contiguous()
        or sum(splits) != out_features or rank % len(splits)
    ):
        return False
    kernel = _lora_delta_kernel(dtype)
    if kernel is None:
        return False
    if num_tokens == 0 or rank == 0:
        return True
    boundaries = (ctypes.c_int * (len(splits) + 1))(0, *[sum(splits[: i + 1]) for i in range(len(splits))])
    status = kernel(x.data_ptr(), x.stride(0), a_slots.data_ptr(), b_slots.data_ptr(), token_slot.data_ptr(),
                    num_slots, y.data_ptr(), y.stride(0), num_tokens, in_features, rank, out_features, len(splits),
                    boundaries, torch.get_num_threads())
    return status == 0
