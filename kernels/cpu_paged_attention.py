"""Paged attention on the CPU: decode steps in a C kernel, everything else in PyTorch.

Same contract and cache layout as `kernels.paged_attention` (see its docstring). A step
whose every request has exactly one query token (steady-state decoding) runs
`kernels/cpu/paged_decode_attention.c`: each (request, KV head) pair reads its K/V rows
in place through the block table, one pass for the scores, a float32 softmax, one pass
for the weighted values. The PyTorch decode path must first gather every request's
blocks into one padded copy and then multiply it in small batched GEMMs; at batch 32
that copy and those GEMMs took about a quarter of a SmolLM2-135M step here.

Batches with prompt chunks, dtypes other than float32 and bfloat16, and machines where
the kernel cannot be built (no C compiler; see `kernels.cpu_build`) go to
`paged_attention_ref`.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kernels.cpu_build import bind, heads_packed
from kernels.paged_attention import paged_attention_ref

_SYMBOLS = {torch.float32: "decode_attention_f32", torch.bfloat16: "decode_attention_bf16"}
_ARGTYPES = [
    ctypes.c_void_p, ctypes.c_int64,  # query, its row stride
    ctypes.c_void_p, ctypes.c_void_p,  # key cache, value cache
    ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,  # block tables, their row stride, seq lens
    ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,  # n, nh, kvh, hd, block size
    ctypes.c_float, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,  # scale, out, its row stride, threads
]


@functools.cache
def _kernel(dtype: torch.dtype):
    """The C decode kernel for `dtype`, or None (unsupported dtype, or no build)."""
    symbol = _SYMBOLS.get(dtype)
    return bind("paged_decode_attention", symbol, _ARGTYPES, ctypes.c_int) if symbol else None


def native_decode_available(dtype: torch.dtype) -> bool:
    return _kernel(dtype) is not None


def decode_attention_native(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> bool:
    """One query token per request (row i of `query` is request i): write `out`'s rows
    with the C kernel and return True, or return False having done nothing, when the
    kernel cannot take these tensors."""
    kernel = _kernel(query.dtype)
    if (
        kernel is None
        or query.device.type != "cpu"
        or not (key_cache.dtype == value_cache.dtype == out.dtype == query.dtype)
        or not (key_cache.is_contiguous() and value_cache.is_contiguous())
        or not (heads_packed(query) and heads_packed(out))
    ):
        return False
    n = seq_lens.shape[0]
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    tables = block_tables if block_tables.dtype == torch.int32 and block_tables.stride(1) == 1 else (
        block_tables.to(torch.int32).contiguous()
    )  # fmt: skip
    lens = seq_lens.to(torch.int32).contiguous()
    status = kernel(
        query.data_ptr(), query.stride(0),
        key_cache.data_ptr(), value_cache.data_ptr(),
        tables.data_ptr(), tables.stride(0), lens.data_ptr(),
        n, query.shape[1], num_kv_heads, head_dim, block_size,
        scale, out.data_ptr(), out.stride(0), torch.get_num_threads(),
    )  # fmt: skip
    if status == 1:
        return False  # head_dim or GQA group beyond the kernel's fixed buffers
    if status != 0:
        raise MemoryError("decode attention kernel: out of memory for its score buffers")
    return True


def paged_attention_cpu(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_attention_ref`'s result; all-decode batches through the C kernel."""
    if out is None:
        out = torch.empty_like(query)
    # At most one token per request and as many tokens as requests: exactly one each,
    # in request order.
    all_decodes = max_query_len == 1 and query.shape[0] == seq_lens.shape[0] > 0
    if all_decodes and decode_attention_native(query, key_cache, value_cache, block_tables, seq_lens, scale, out):
        return out
    return paged_attention_ref(
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale,
        max_query_len, max_seq_len, out=out,
    )  # fmt: skip
