"""Writing new keys and values into the paged KV cache by slot mapping.

The worker calls this once per layer before attention: token t's K/V go to
cache[slot // block_size, slot % block_size], slot = slot_mapping[t]; a negative slot
(a padding token) is skipped. Caches are [num_blocks, block_size, num_kv_heads, head_dim].
`write_kv_ref` is the PyTorch reference; `write_kv_cpu` the CPU path (`kernels/cpu/write_kv.c`:
one call for K and V, padding slots skipped in C; without a C compiler, one `index_copy_`
per cache when no slot is negative);
`write_kv_triton` is the GPU kernel: one program per token, all its kv heads.
"""

import ctypes

import torch

from kernels.cpu_build import bind, heads_packed, kernel_binding
from kernels.triton_import import tl, triton


def write_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter key/value [T, kvh, hd] into the caches in place (rounded to the caches' dtype
    where it is narrower, e.g. bfloat16 under a float32 model); negative slots are skipped."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    # view() (not reshape) so that a non-contiguous cache raises instead of writing a copy.
    key_cache.view(-1, *key_cache.shape[2:])[slots] = key[valid].to(key_cache.dtype)
    value_cache.view(-1, *value_cache.shape[2:])[slots] = value[valid].to(value_cache.dtype)


_WRITE_KV_ARGS = [
    ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,  # key, value and their row strides (bytes)
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,  # key cache, value cache, slots
    ctypes.c_int, ctypes.c_int64, ctypes.c_int64,  # tokens, slots in the cache, bytes per row
]


@kernel_binding
def _write_kv_kernel_cpu():
    return bind("write_kv", "write_kv", _WRITE_KV_ARGS, ctypes.c_int)


def _write_kv_native(key, value, key_cache, value_cache, slot_mapping) -> bool:
    """Write through the C kernel and return True, or return False having done nothing."""
    kernel = _write_kv_kernel_cpu()
    if (
        kernel is None
        or key.device.type != "cpu"
        or not (key.dtype == value.dtype == key_cache.dtype == value_cache.dtype)
        or not (key.shape == value.shape and key_cache.shape == value_cache.shape)
        or key.shape[1:] != key_cache.shape[2:]
        or not (heads_packed(key) and heads_packed(value))
        or not (key_cache.is_contiguous() and value_cache.is_contiguous())
        or slot_mapping.dtype != torch.int64
        or slot_mapping.shape != key.shape[:1]
    ):
        return False
    slots = slot_mapping.contiguous()
    elem = key.element_size()
    status = kernel(
        key.data_ptr(), key.stride(0) * elem, value.data_ptr(), value.stride(0) * elem,
        key_cache.data_ptr(), value_cache.data_ptr(), slots.data_ptr(),
        key.shape[0], key_cache.shape[0] * key_cache.shape[1], key.shape[1] * key.shape[2] * elem,
    )  # fmt: skip
    if status != 0:
        raise IndexError(f"write_kv: a slot is outside the cache's {key_cache.shape[0] * key_cache.shape[1]} slots")
    return True


def write_kv_cpu(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """`write_kv_ref`'s result: through the C kernel where it applies (CPU tensors of one
    dtype, each token's heads packed, contiguous caches, int64 slots); otherwise without
    boolean masks when no slot is negative. K/V of another dtype than the caches' are
    converted first."""
    if key.dtype != key_cache.dtype or value.dtype != value_cache.dtype:
        key, value = key.to(key_cache.dtype), value.to(value_cache.dtype)
    if _write_kv_native(key, value, key_cache, value_cache, slot_mapping):
        return
    if slot_mapping.dtype != torch.int64 or bool((slot_mapping < 0).any()):
        write_kv_ref(key, value, key_cache, value_cache, slot_mapping)
        return
    key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, slot_mapping, value)


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    key_token_stride,
    key_head_stride,
    value_token_stride,
    value_head_stride,
    cache_block_stride,
    cache_slot_stride,
    cache_head_stride,
    block_size,
    num_kv_heads,
    head_dim,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        heads = tl.arange(0, BLOCK_HEADS)[:, None]
        dims = tl.arange(0, BLOCK_DIM)[None, :]
        mask = (heads < num_kv_heads) & (dims < head_dim)
        cache_offsets = (
            (slot // block_size) * cache_block_stride
            + (slot % block_size) * cache_slot_stride
            + heads * cache_head_stride
            + dims
        )
        k = tl.load(key_ptr + token * key_token_stride + heads * key_head_stride + dims, mask=mask)
        v = tl.load(
            value_ptr + token * value_token_stride + heads * value_head_stride + dims, mask=mask
        )
        tl.store(key_cache_ptr + cache_offsets, k, mask=mask)
        tl.store(value_cache_ptr + cache_offsets, v, mask=mask)


def write_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton scatter of key/value [T, kvh, hd] into the paged caches; negative slots skipped."""
    assert key.stride(-1) == 1 and value.stride(-1) == 1
    assert key_cache.stride() == value_cache.stride() and key_cache.stride(-1) == 1
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        key_cache.shape[1],
        num_kv_heads,
        head_dim,
        BLOCK_HEADS=triton.next_power_of_2(num_kv_heads),
        BLOCK_DIM=triton.next_power_of_2(head_dim),
    )
