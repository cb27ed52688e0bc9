"""The "torch" backend's paged attention: the PyTorch reference, and the C decode kernel.

The worker calls `paged_attention` once per layer after `write_kv` has put the step's new
K/V into the paged cache; the step's requests, their query tokens and their block tables
come in one `AttentionMetadata` (see `kernels.attention_metadata`). Request i's token j
sits at position seq_lens[i] - q_len_i + j and attends causally to cache positions
0..that position. GQA: query head h reads kv head h // (num_heads // num_kv_heads).
`kernels.paged_attention` holds the Triton kernel, with the same contract.

`paged_attention_ref` is the PyTorch reference, and the CPU path wherever the C decode
kernel does not apply. With a sliding window (``AttentionMetadata.sliding_window``) each
request reads only the blocks from its first query's window on. Decodes read their blocks with one `index_select` and attend with
batched matmuls straight on the cache's [token, kv head, dim] rows (no transposed copy of
K/V: that copy, not the arithmetic, is what a padded SDPA call spends its time on at
decode); what an all-decode step's layers share (block list, key mask) is built by its
first layer into the step's metadata. Prefill chunks go through one padded SDPA call per
query-length bucket.

`paged_attention_cpu` runs a step whose every request has exactly one query token
(steady-state decoding), or only a few (a decode and its draft tokens: each query token
then runs as a decode of its own), in `kernels/cpu/paged_decode_attention.c`: each (request, KV
head) pair reads its K/V rows in place through the block table, one pass for the scores,
a float32 softmax, one pass for the weighted values. The PyTorch decode path must first
gather every request's blocks into one padded copy and then multiply it in small batched
GEMMs; at batch 32 that copy and those GEMMs took about a quarter of a SmolLM2-135M step
here. Batches with prompt chunks, dtypes other than float32 and bfloat16, and machines
where the kernel cannot be built (no C compiler; see `kernels.cpu_build`) go to
`paged_attention_ref`.

The caches hold the query's dtype, or bfloat16 under a float32 query (`--kv-cache-dtype
bfloat16`: half the bytes to store and to read); both paths compute in the query's dtype,
the reference widening the K/V it reads.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from kernels.attention_metadata import AttentionMetadata, DecodePlan
from kernels.cpu_build import bind, heads_packed, kernel_binding


def _first_blocks(first_queries: torch.Tensor, window: int | None, block_size: int) -> torch.Tensor:
    """[N] int64: each request's first block any of its queries sees (0 without a window;
    with one, the block of position ``first_query - window + 1``)."""
    if window is None:
        return torch.zeros_like(first_queries)
    return (first_queries - window + 1).clamp(min=0) // block_size


def _used_blocks(
    block_tables: torch.Tensor, first_blocks: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int, block_size: int
) -> torch.Tensor:
    """[N, num_blocks] int64: request i's blocks first_blocks[i], first_blocks[i] + 1, ...;
    block 0 past its last one (table entries there may be garbage, even out of range)."""
    index = first_blocks[:, None] + torch.arange(num_blocks, device=first_blocks.device)
    needed = (seq_lens.long() + block_size - 1) // block_size
    in_use = index < needed[:, None]
    blocks = block_tables.long().gather(1, torch.where(in_use, index, 0).clamp(max=block_tables.shape[1] - 1))
    return torch.where(in_use, blocks, 0)


def _span_blocks(first_blocks: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> int:
    """Blocks to gather per request: the most any request needs from its first block."""
    needed = (seq_lens.long() + block_size - 1) // block_size - first_blocks
    return max(int(needed.max()), 1)


def _gather_kv(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Cache [num_blocks, bs, kvh, hd] -> [N, kvh, len(blocks[i]) * bs, hd] through each
    request's blocks."""
    return cache[blocks].flatten(1, 2).transpose(1, 2)


def _widened(kv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gathered K/V in the query's dtype (a bfloat16 cache under a float32 query)."""
    return kv if kv.dtype == dtype else kv.to(dtype)


def _decode_plan(
    block_tables: torch.Tensor, query_rows: torch.Tensor | None, seq_lens: torch.Tensor, window: int | None,
    block_size: int,
) -> DecodePlan:  # fmt: skip
    n = seq_lens.shape[0]
    seq_lens = seq_lens.long()
    first_blocks = _first_blocks(seq_lens - 1, window, block_size)
    blocks = _used_blocks(block_tables, first_blocks, seq_lens, _span_blocks(first_blocks, seq_lens, block_size),
                          block_size)
    span = blocks.shape[1] * block_size
    positions = first_blocks[:, None] * block_size + torch.arange(span, device=seq_lens.device)[None, :]
    hidden = positions >= seq_lens[:, None]
    if window is not None:
        hidden |= positions <= (seq_lens - 1 - window)[:, None]
    bias = torch.zeros(n, 1, span, device=seq_lens.device).masked_fill_(hidden[:, None, :], float("-inf"))
    return DecodePlan(blocks.flatten(), span, bias, query_rows)


def _all_decodes(query: torch.Tensor, attn: AttentionMetadata) -> bool:
    """Whether every request has exactly one query token (then row i is request i): at most
    one token each and as many tokens as requests."""
    return attn.max_query_len == 1 and query.shape[0] == attn.seq_lens.shape[0] > 0


@functools.lru_cache(maxsize=16)
def _head_selector(num_kv_heads: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[1, kvh, 1, kvh, 1]: 1 where a query head's KV head meets its own columns."""
    eye = torch.eye(num_kv_heads, dtype=dtype, device=device)
    return eye.view(1, num_kv_heads, 1, num_kv_heads, 1)


def _attend_decodes(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: DecodePlan,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Requests with one query token each; writes their rows of `out`."""
    n = plan.bias.shape[0]
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads
    span = plan.span
    k = _widened(key_cache.index_select(0, plan.blocks), query.dtype).view(n, span, num_kv_heads * head_dim)
    v = _widened(value_cache.index_select(0, plan.blocks), query.dtype).view(n, span, num_kv_heads * head_dim)
    rows = query[:n] if plan.query_rows is None else query.index_select(0, plan.query_rows)
    q = rows.view(n, num_kv_heads, group, head_dim)
    if query.dtype == torch.float32:
        # One product per KV head on a strided view of K/V (fp32 GEMMs take the strides).
        k, v = k.view(n, span, num_kv_heads, head_dim), v.view(n, span, num_kv_heads, head_dim)
        scores = torch.empty(n, num_kv_heads, group, span, dtype=query.dtype, device=query.device)
        for h in range(num_kv_heads):
            scores[:, h] = torch.bmm(q[:, h], k[:, :, h].transpose(1, 2))
        scores = scores.view(n, num_heads, span).mul_(scale)
    else:
        # bf16/fp16 GEMMs copy a strided operand, so K/V are read whole: each query head
        # is placed in its KV head's columns of a zero row (block-diagonal queries), one
        # product gives every head's scores, and the output keeps each head's own block.
        # The zeros triple tiny products but save the copies.
        selector = _head_selector(num_kv_heads, query.dtype, query.device)
        q_rows = (q.unsqueeze(3) * selector).view(n, num_heads, num_kv_heads * head_dim)
        scores = torch.bmm(q_rows, k.transpose(1, 2)).float().mul_(scale)
    # Adding 0 / -inf is exactly a masked fill of the hidden keys.
    probs = torch.softmax(scores.add_(plan.bias), dim=-1).to(query.dtype)  # [n, num_heads, span]
    if query.dtype == torch.float32:
        probs = probs.view(n, num_kv_heads, group, span)
        o = torch.empty(n, num_kv_heads, group, head_dim, dtype=query.dtype, device=query.device)
        for h in range(num_kv_heads):
            o[:, h] = torch.bmm(probs[:, h], v[:, :, h])
    else:
        # [n, kvh, group, kvh, hd] -> each query head's own KV head block [n, kvh, group, hd]
        o = torch.diagonal(torch.bmm(probs, v).view(n, num_kv_heads, group, num_kv_heads, head_dim), 0, 1, 3)
        o = o.permute(0, 3, 1, 2)
    if plan.query_rows is None:
        out[:n].view(n, num_kv_heads, group, head_dim).copy_(o)
    else:
        out[plan.query_rows] = o.reshape(n, num_heads, head_dim)


def _attend_group(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_starts: torch.Tensor,
    query_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None,
    max_query_len: int,
    out: torch.Tensor,
) -> None:
    """One padded SDPA call for a group of requests; writes their rows of `out`."""
    device = query.device
    block_size = key_cache.shape[1]
    q_offsets = torch.arange(max_query_len, device=device)
    is_real = q_offsets[None, :] < query_lens[:, None]  # [N, Lq]
    tokens = torch.where(is_real, query_starts[:, None] + q_offsets, 0)
    q = query[tokens].transpose(1, 2)  # [N, nh, Lq, hd]
    first_positions = seq_lens - query_lens
    first_blocks = _first_blocks(first_positions, window, block_size)
    blocks = _used_blocks(block_tables, first_blocks, seq_lens, _span_blocks(first_blocks, seq_lens, block_size),
                          block_size)
    k = _widened(_gather_kv(key_cache, blocks), query.dtype)
    v = _widened(_gather_kv(value_cache, blocks), query.dtype)
    # Causal (and windowed) over absolute positions; padded query rows see at least their
    # first key, so no row is all masked (which would give NaN). Keys past seq_len are never
    # visible to a real row.
    k_positions = first_blocks[:, None] * block_size + torch.arange(k.shape[2], device=device)  # [N, S]
    q_positions = first_positions[:, None] + q_offsets  # [N, Lq]
    mask = k_positions[:, None, :] <= q_positions[:, :, None]  # [N, Lq, S]
    if window is not None:
        mask &= k_positions[:, None, :] > (q_positions - window)[:, :, None]
    o = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask[:, None], scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    out[tokens[is_real]] = o.transpose(1, 2)[is_real]


def paged_attention_ref(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    attn: AttentionMetadata,
    scale: float,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [T, nh, hd] -> out [T, nh, hd]; see the module docstring for the layout.

    `out`, if given, is a preallocated [T, nh, hd] tensor the result is written into.
    An all-decode step's first call stores its decode plan in `attn` for the other layers.

    The caches must hold finite values everywhere (zeros or old K/V, never torch.empty
    garbage): masked padding keys still enter the padded SDPA, and 0 * NaN is NaN.
    """
    if out is None:
        out = torch.empty_like(query)
    if query.shape[0] == 0:
        return out
    block_size = key_cache.shape[1]
    if _all_decodes(query, attn):
        if attn.decode_plan is None:
            attn.decode_plan = _decode_plan(attn.block_tables, None, attn.seq_lens, attn.sliding_window, block_size)
        _attend_decodes(query, key_cache, value_cache, attn.decode_plan, scale, out)
        return out
    seq_lens = attn.seq_lens.long()
    query_start_loc = attn.query_start_loc.long()
    query_starts = query_start_loc[:-1]
    query_lens = query_start_loc[1:] - query_starts
    # Padding every request to the batch's longest query would cost O(B * max_query_len),
    # e.g. 128 decodes next to one 2k-token chunk; bucketing requests by the power of two
    # of their query length bounds the padding to 2x per bucket, in a few SDPA calls.
    # Requests with no query token this step (bucket -1) have nothing to attend.
    buckets = torch.ceil(torch.log2(query_lens.clamp(min=1).double())).long()
    buckets = torch.where(query_lens > 0, buckets, -1)
    for bucket in torch.unique(buckets).tolist():
        if bucket < 0:
            continue
        reqs = torch.nonzero(buckets == bucket).squeeze(1)
        group_query_lens = query_lens[reqs]
        group_seq_lens = seq_lens[reqs]
        block_tables = attn.block_tables[reqs]
        if bucket == 0:  # one query token each
            plan = _decode_plan(block_tables, query_starts[reqs], group_seq_lens, attn.sliding_window, block_size)
            _attend_decodes(query, key_cache, value_cache, plan, scale, out)
            continue
        _attend_group(
            query, key_cache, value_cache, block_tables, query_starts[reqs],
            group_query_lens, group_seq_lens, scale, attn.sliding_window, int(group_query_lens.max()), out,
        )  # fmt: skip
    return out


# (query dtype, cache dtype) -> the C kernel's entry point.
_SYMBOLS = {
    (torch.float32, torch.float32): "decode_attention_f32",
    (torch.bfloat16, torch.bfloat16): "decode_attention_bf16",
    (torch.float32, torch.bfloat16): "decode_attention_f32_bf16kv",
}
_ARGTYPES = [
    ctypes.c_void_p, ctypes.c_int64,  # query, its row stride
    ctypes.c_void_p, ctypes.c_void_p,  # key cache, value cache
    ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,  # block tables, their row stride, seq lens
    ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,  # n, nh, kvh, hd, block size
    ctypes.c_int,  # sliding window (0: none)
    ctypes.c_float, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,  # scale, out, its row stride, threads
]


@kernel_binding
def _kernel(dtype: torch.dtype, cache_dtype: torch.dtype):
    """The C decode kernel for a `dtype` query over `cache_dtype` caches, or None
    (unsupported pairing, or no build)."""
    symbol = _SYMBOLS.get((dtype, cache_dtype))
    return bind("paged_decode_attention", symbol, _ARGTYPES, ctypes.c_int) if symbol else None


def native_decode_available(dtype: torch.dtype, cache_dtype: torch.dtype | None = None) -> bool:
    return _kernel(dtype, cache_dtype or dtype) is not None


def decode_attention_native(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    window: int | None = None,
) -> bool:
    """One query token per request (row i of `query` is request i): write `out`'s rows
    with the C kernel and return True, or return False having done nothing, when the
    kernel cannot take these tensors. ``window``: each query sees its last ``window``
    positions only."""
    kernel = _kernel(query.dtype, key_cache.dtype)
    if (
        kernel is None
        or query.device.type != "cpu"
        or not (key_cache.dtype == value_cache.dtype and out.dtype == query.dtype)
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
        n, query.shape[1], num_kv_heads, head_dim, block_size, window or 0,
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
    attn: AttentionMetadata,
    scale: float,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_attention_ref`'s result; all-decode batches through the C kernel, and so are
    batches of short queries, one decode per query token."""
    if out is None:
        out = torch.empty_like(query)
    if _all_decodes(query, attn) and decode_attention_native(
        query, key_cache, value_cache, attn.block_tables, attn.seq_lens, scale, out, attn.sliding_window
    ):
        return out
    if 1 < attn.max_query_len <= SHORT_QUERY_MAX and query.shape[0] > 0:
        if attn.token_decodes is None:
            attn.token_decodes = _token_decodes(attn)
        block_tables, seq_lens = attn.token_decodes
        if decode_attention_native(query, key_cache, value_cache, block_tables, seq_lens, scale, out,
                                   attn.sliding_window):
            return out
    return paged_attention_ref(query, key_cache, value_cache, attn, scale, out=out)


# Queries up to this many tokens per request (a decode and its draft tokens) run as one
# decode per token: each reads its context once more, where a padded SDPA call would copy
# the whole context first, and a lone draft would take every decode of the batch off the
# C kernel.
SHORT_QUERY_MAX = 17


def _token_decodes(attn: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query token as a decode: its request's block table row, and its context (the
    tokens up to and including its own, which causal attention sees)."""
    starts = attn.query_start_loc.long()
    query_lens = starts[1:] - starts[:-1]
    request_of = torch.repeat_interleave(torch.arange(len(query_lens), device=starts.device), query_lens)
    offset = torch.arange(int(starts[-1]), device=starts.device) - starts[:-1][request_of]
    first_position = attn.seq_lens.long() - query_lens
    seq_lens = first_position[request_of] + offset + 1
    return attn.block_tables[request_of], seq_lens.to(torch.int32)
