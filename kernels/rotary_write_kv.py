"""The rotary embedding of q and k, then k and v into the paged KV cache: one call per layer.

Every decoder layer runs the two back to back on the slices of its fused qkv product
(see `kernels.rotary` and `kernels.write_kv` for each one's contract). On the CPU they
are one C call (`rotary_write_kv` in `kernels/cpu/rotary.c`) with one set of checks:
at batch 1 the two Python wrappers, not the work, were most of their time (about 30 us
per layer, 1 ms per step of SmolLM2's 30 layers). `rotary_write_kv_ref` is the PyTorch
reference (the two references in turn); `rotary_write_kv_cpu` the CPU path, which falls
back to the two CPU paths wherever the C kernel does not apply;
`rotary_write_kv_triton` runs the two Triton kernels.
"""

from __future__ import annotations

import ctypes

import torch

from kernels.cpu_build import bind, kernel_binding
from kernels.rotary import _ROTARY_ARGS, rotary_embedding_cpu, rotary_embedding_ref, rotary_embedding_triton
from kernels.write_kv import write_kv_cpu, write_kv_ref, write_kv_triton


def rotary_write_kv_ref(positions, q, k, v, cos_sin_cache, head_dim, key_cache, value_cache, slot_mapping) -> None:
    """Rotate q [T, nh*hd] and k [T, kvh*hd] in place, then write k and v [T, kvh*hd] into
    the caches [num_blocks, block_size, kvh, hd] at `slot_mapping` (negative: skipped)."""
    rotary_embedding_ref(positions, q, k, cos_sin_cache, head_dim)
    rows = k.shape[0]
    write_kv_ref(k.view(rows, -1, head_dim), v.view(rows, -1, head_dim), key_cache, value_cache, slot_mapping)


# (q/k/v dtype, cache dtype) -> the C kernel's entry point.
_SYMBOLS = {
    (torch.float32, torch.float32): "rotary_write_kv_f32",
    (torch.bfloat16, torch.bfloat16): "rotary_write_kv_bf16",
    (torch.float32, torch.bfloat16): "rotary_write_kv_f32_bf16kv",  # --kv-cache-dtype bfloat16
}
_ARGS = [
    *_ROTARY_ARGS,  # the rotary kernel's, then:
    ctypes.c_void_p, ctypes.c_int64,  # v, its row stride
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,  # key cache, value cache, slots, slot count
]


@kernel_binding
def _kernel_cpu(dtype: torch.dtype, cache_dtype: torch.dtype):
    symbol = _SYMBOLS.get((dtype, cache_dtype))
    return bind("rotary", symbol, _ARGS, ctypes.c_int) if symbol else None


def _rows_fit(x: torch.Tensor, width: int, dtype: torch.dtype) -> bool:
    """x is [T, width] of `dtype` on the CPU with its values packed in each row."""
    return x.dim() == 2 and x.shape[1] == width and x.stride(1) == 1 and x.dtype == dtype and x.device.type == "cpu"


def rotary_write_kv_cpu(positions, q, k, v, cos_sin_cache, head_dim, key_cache, value_cache, slot_mapping) -> None:
    """`rotary_write_kv_ref`'s result: one C call where it applies (float32 or bfloat16 2-D
    q/k/v with packed rows, contiguous caches, int64 positions and slots, a float32
    table), else the rotary and KV-write CPU paths in turn."""
    kernel = _kernel_cpu(q.dtype, key_cache.dtype)
    dtype = q.dtype
    if (
        kernel is not None
        and key_cache.dim() == 4
        and key_cache.shape[3] == head_dim
        and _rows_fit(q, q.shape[1], dtype)
        and _rows_fit(k, key_cache.shape[2] * head_dim, dtype)
        and _rows_fit(v, k.shape[1], dtype)
        and q.shape[1] % head_dim == 0
        and key_cache.dtype == value_cache.dtype
        and key_cache.shape == value_cache.shape
        and key_cache.is_contiguous()
        and value_cache.is_contiguous()
        and positions.dtype == slot_mapping.dtype == torch.int64
        and positions.is_contiguous()
        and slot_mapping.is_contiguous()
        and positions.shape[0] == slot_mapping.shape[0] == q.shape[0] == k.shape[0] == v.shape[0]
        and cos_sin_cache.dtype == torch.float32
        and cos_sin_cache.stride(-1) == 1
        and head_dim % 2 == 0
    ):
        status = kernel(
            positions.data_ptr(), q.shape[0],
            q.data_ptr(), q.stride(0), q.shape[1] // head_dim,
            k.data_ptr(), k.stride(0), key_cache.shape[2],
            cos_sin_cache.data_ptr(), cos_sin_cache.stride(0), cos_sin_cache.shape[0],
            head_dim, torch.get_num_threads(),
            v.data_ptr(), v.stride(0),
            key_cache.data_ptr(), value_cache.data_ptr(), slot_mapping.data_ptr(),
            key_cache.shape[0] * key_cache.shape[1],
        )  # fmt: skip
        if status == 1:
            raise IndexError(f"rotary embedding: a position is outside the table's {cos_sin_cache.shape[0]} rows")
        if status == 2:
            raise IndexError(f"write_kv: a slot is outside the cache's {key_cache.shape[0] * key_cache.shape[1]} slots")
        return
    rotary_embedding_cpu(positions, q, k, cos_sin_cache, head_dim)
    rows = k.shape[0]
    write_kv_cpu(k.view(rows, -1, head_dim), v.view(rows, -1, head_dim), key_cache, value_cache, slot_mapping)


def rotary_write_kv_triton(positions, q, k, v, cos_sin_cache, head_dim, key_cache, value_cache, slot_mapping) -> None:
    """The Triton rotary embedding, then the Triton KV write."""
    rotary_embedding_triton(positions, q, k, cos_sin_cache, head_dim)
    rows = k.shape[0]
    write_kv_triton(k.view(rows, -1, head_dim), v.view(rows, -1, head_dim), key_cache, value_cache, slot_mapping)
