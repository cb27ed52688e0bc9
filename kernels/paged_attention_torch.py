"""The "torch" backend's paged attention: the PyTorch reference, and the C decode and prefill kernels.

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
here. Prompt chunks (more than SHORT_QUERY_MAX query tokens) of a bfloat16 model go, all of
a step's in one call, to `kernels/cpu/prefill_attention.c` where it is built for
AVX512_BF16: flash attention that computes nothing above the causal diagonal and reads each
KV head's K/V once for its group of query heads (the padded SDPA call computes every score
of its square, masked, twice the causal work for a chunk without a prefix; the kernel runs
~3x faster per layer). Elsewhere chunks of LONG_QUERY_MIN tokens or more take PyTorch's
flash attention request by request (`_attend_long`). What is left (shorter chunks, the
decodes of a mixed step, machines where no kernel can be built: no C compiler, see
`kernels.cpu_build`) goes to `paged_attention_ref`.

`paged_attention_cpu_batch_invariant` (the default, `--batch-invariant`) gives every query
token of every step, prompt chunks included, the bits the C decode kernel gives it as a
decode at its position: a token's result is then a function of its query, its context's
K/V and nothing else (not the step's other requests, not how its prompt was chunked, not
whether its prefix came from the prefix cache, and a recomputed generated token equals its
decoded self), so greedy output does not depend on the batch. An all-decode step runs the
decode kernel; a step with prompt chunks (bfloat16 query and caches, a build with
AVX512_BF16, an even block size) runs the same kernel's multi-row entry
(`decode_attention_rows_native`): tiles of consecutive query tokens of a request, with all
the query heads of a KV head, go through the context together, each K run copied once and
its scores computed per token exactly as a decode computes them, each V run interleaved
into pairs of positions once and multiplied into every row's accumulators (`vdpbf16ps`,
weights rounded to bf16, the decode's values arithmetic too). Equal bits by construction,
and faster than the C prefill kernel (a 2,048-token chunk's layer ~20 ms against ~30 ms
on a 2-vCPU Zen 4, one thread; docs/BENCHMARKS-diary.md, "Long prompts"). Elsewhere
(float32, AVX2 builds, odd block sizes) each query token runs as a decode of its own
through the decode kernel, and the reference only where the kernel cannot run at all.

The caches hold the query's dtype, or bfloat16 under a float32 query (`--kv-cache-dtype
bfloat16`: half the bytes to store and to read); both paths compute in the query's dtype,
the reference widening the K/V it reads.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from kernels.attention_metadata import AttentionMetadata, DecodePlan, PrefillPlan
from kernels.cpu_build import bind, heads_packed, kernel_binding, library_isa


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
    skip: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [T, nh, hd] -> out [T, nh, hd]; see the module docstring for the layout.

    `out`, if given, is a preallocated [T, nh, hd] tensor the result is written into;
    `skip` [N] bool: requests whose rows are left alone (another path attends them).
    An all-decode step's first call stores its decode plan in `attn` for the other layers.

    The caches must hold finite values everywhere (zeros or old K/V, never torch.empty
    garbage): masked padding keys still enter the padded SDPA, and 0 * NaN is NaN.
    """
    if out is None:
        out = torch.empty_like(query)
    if query.shape[0] == 0:
        return out
    block_size = key_cache.shape[1]
    if skip is None and _all_decodes(query, attn):
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
    if skip is not None:
        buckets = torch.where(skip, -1, buckets)
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


_ROWS_ARGTYPES = [
    ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,  # query, its row stride, caches
    ctypes.c_void_p, ctypes.c_int64,  # block tables, their row stride
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,  # query starts, query lens, seq lens, n
    ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,  # nh, kvh, hd, block size, window
    ctypes.c_float, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,  # scale, out, its row stride, threads
]


@kernel_binding
def _rows_kernel():
    """The C decode kernel's multi-row entry point (bfloat16 query and caches), or None."""
    return bind("paged_decode_attention", "decode_attention_rows_bf16", _ROWS_ARGTYPES, ctypes.c_int)


def decode_attention_rows_native(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    attn: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
) -> bool:
    """Every query token of the step attended as the C decode kernel attends a decode at its
    position, bit for bit, several tokens of a request at a time (each K/V run read once for
    them): write `out` and return True, or return False having done nothing where the
    kernel has no multi-row code for these tensors (then run one decode per token)."""
    kernel = _rows_kernel()
    if (
        kernel is None
        or query.device.type != "cpu"
        or not (query.dtype == key_cache.dtype == value_cache.dtype == out.dtype == torch.bfloat16)
        or not (key_cache.is_contiguous() and value_cache.is_contiguous())
        or not (heads_packed(query) and heads_packed(out))
    ):
        return False
    if attn.request_rows is None:
        query_lens = attn.query_start_loc[1:] - attn.query_start_loc[:-1]
        attn.request_rows = tuple(t.to(torch.int32).contiguous() for t in (
            attn.block_tables, attn.query_start_loc[:-1], query_lens, attn.seq_lens))
    tables, starts, lens, seq_lens = attn.request_rows
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    status = kernel(
        query.data_ptr(), query.stride(0), key_cache.data_ptr(), value_cache.data_ptr(),
        tables.data_ptr(), tables.stride(0), starts.data_ptr(), lens.data_ptr(), seq_lens.data_ptr(), len(lens),
        query.shape[1], num_kv_heads, head_dim, block_size, attn.sliding_window or 0,
        scale, out.data_ptr(), out.stride(0), torch.get_num_threads(),
    )  # fmt: skip
    if status == 1:
        return False
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
        block_tables, seq_lens = _token_decodes(attn)
        if decode_attention_native(query, key_cache, value_cache, block_tables, seq_lens, scale, out,
                                   attn.sliding_window):
            return out
    # The prefill kernel and flash attention read a chunk's whole context: a sliding window's
    # chunks go to the reference, which reads only the blocks in each window.
    if attn.max_query_len > SHORT_QUERY_MAX and not attn.sliding_window:
        if attn.prefill_plan is None:
            attn.prefill_plan = _prefill_plan(query, key_cache, attn)
        plan = attn.prefill_plan
        if plan.native is not None:
            _run_prefill_kernel(query, key_cache, value_cache, plan.native, scale, out)
        else:
            for table, start, length, seq_len in plan.long:
                _attend_long(query, key_cache, value_cache, table, start, length, seq_len, scale, out)
        if plan.all_taken:
            return out
        return paged_attention_ref(query, key_cache, value_cache, attn, scale, out=out, skip=plan.taken)
    return paged_attention_ref(query, key_cache, value_cache, attn, scale, out=out)


def paged_attention_cpu_batch_invariant(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    attn: AttentionMetadata,
    scale: float,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_attention_ref`'s result with every query token given the bits the C decode
    kernel gives it alone (prompt chunks through its multi-row entry where built, else one
    decode per token); the reference, which is not batch invariant, only where the kernel
    cannot take these tensors."""
    if out is None:
        out = torch.empty_like(query)
    if query.shape[0] == 0:
        return out
    if _all_decodes(query, attn):
        block_tables, seq_lens = attn.block_tables, attn.seq_lens
    elif decode_attention_rows_native(query, key_cache, value_cache, attn, scale, out):
        return out
    else:
        block_tables, seq_lens = _token_decodes(attn)
    if decode_attention_native(query, key_cache, value_cache, block_tables, seq_lens, scale, out,
                               attn.sliding_window):
        return out
    return paged_attention_ref(query, key_cache, value_cache, attn, scale, out=out)


def _prefill_plan(query: torch.Tensor, key_cache: torch.Tensor, attn: AttentionMetadata) -> PrefillPlan:
    """The C kernel takes every request with more than SHORT_QUERY_MAX query tokens (one
    call per layer for all of them); without it, requests of LONG_QUERY_MIN tokens or more
    take PyTorch's flash attention one by one; the others stay with the reference."""
    query_lens = (attn.query_start_loc[1:] - attn.query_start_loc[:-1]).long()
    chunks = query_lens > SHORT_QUERY_MAX
    if prefill_kernel_takes(query, key_cache):
        native = tuple(t.to(torch.int32).contiguous() for t in (
            attn.block_tables[chunks], attn.query_start_loc[:-1][chunks], query_lens[chunks], attn.seq_lens[chunks]))
        return PrefillPlan(chunks, bool(chunks.all()), native, [])
    long = query_lens >= LONG_QUERY_MIN
    starts, lens, seq_lens = (t.tolist() for t in (attn.query_start_loc[:-1][long], query_lens[long],
                                                   attn.seq_lens[long]))
    return PrefillPlan(long, bool(long.all()), None, list(zip(attn.block_tables[long], starts, lens, seq_lens)))


# Without the C prefill kernel, prompt chunks of at least this many query tokens attend
# request by request, causally (`_attend_long`): a padded SDPA call with a mask computes
# every (query, key) score of its square, twice the causal ones for a chunk without a
# prefix; per request, the Python around the calls is small next to the chunk's work.
LONG_QUERY_MIN = 256


def _attend_long(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
    start: int, length: int, seq_len: int, scale: float, out: torch.Tensor,
) -> None:
    """One request's chunk of `length` query tokens (rows start..start+length) at the end of
    its `seq_len` keys, through PyTorch's flash attention: the chunk's own keys causally
    (only the scores at or below the diagonal), the keys before it (a cached prefix, or
    earlier chunks) in full and unmasked, the two softmaxes merged by their log-sum-exps."""
    block_size, num_kv_heads, head_dim = key_cache.shape[1:]
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads
    prefix = seq_len - length
    blocks = block_table[: -(-seq_len // block_size)].long()
    keys = _widened(key_cache[blocks].flatten(0, 1)[:seq_len], query.dtype).transpose(0, 1)  # [kvh, S, hd]
    values = _widened(value_cache[blocks].flatten(0, 1)[:seq_len], query.dtype).transpose(0, 1)
    q = query[start : start + length].transpose(0, 1)  # [nh, Lq, hd]
    rows = out[start : start + length]
    if prefix == 0:
        o = F.scaled_dot_product_attention(q[None], keys[None], values[None], is_causal=True, scale=scale,
                                           enable_gqa=group > 1)
        rows.copy_(o[0].transpose(0, 1))
        return
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    # The chunk's own keys, causal from its first query (SDPA's top-left diagonal).
    own_k = keys[:, prefix:].repeat_interleave(group, dim=0)
    own_v = values[:, prefix:].repeat_interleave(group, dim=0)
    o_own, lse_own = flash(q[None], own_k[None], own_v[None], 0.0, True, scale=scale)
    # The keys before it, seen by every query: a KV head's query heads side by side along
    # the query axis, so K/V are read once per KV head and never copied per query head.
    q_by_kv = q.reshape(num_kv_heads, group * length, head_dim)
    o_pre, lse_pre = flash(q_by_kv[None], keys[None, :, :prefix], values[None, :, :prefix], 0.0, False,
                           scale=scale)
    o_pre, lse_pre = o_pre.reshape(num_heads, length, head_dim), lse_pre.reshape(num_heads, length)
    lse = torch.logaddexp(lse_own[0], lse_pre)
    merged = o_own[0].float() * torch.exp(lse_own[0] - lse).unsqueeze(-1)
    merged.addcmul_(o_pre.float(), torch.exp(lse_pre - lse).unsqueeze(-1))
    rows.copy_(merged.transpose(0, 1))


# Queries up to this many tokens per request (a decode and its draft tokens) run as one
# decode per token: each reads its context once more, where a padded SDPA call would copy
# the whole context first, and a lone draft would take every decode of the batch off the
# C kernel.
SHORT_QUERY_MAX = 17


def _token_decodes(attn: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query token as a decode: its request's block table row, and its context (the
    tokens up to and including its own, which causal attention sees); built by the step's
    first layer, kept in ``attn`` for the others."""
    if attn.token_decodes is None:
        attn.token_decodes = _build_token_decodes(attn)
    return attn.token_decodes


def _build_token_decodes(attn: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    starts = attn.query_start_loc.long()
    query_lens = starts[1:] - starts[:-1]
    request_of = torch.repeat_interleave(torch.arange(len(query_lens), device=starts.device), query_lens)
    offset = torch.arange(int(starts[-1]), device=starts.device) - starts[:-1][request_of]
    first_position = attn.seq_lens.long() - query_lens
    seq_lens = first_position[request_of] + offset + 1
    return attn.block_tables[request_of], seq_lens.to(torch.int32)


_PREFILL_ARGTYPES = [
    ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,  # query, its row stride, caches
    ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,  # tables, ...
    ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,  # nh, kvh, hd, block size
    ctypes.c_float, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,  # scale, out, its row stride, threads
]
# Head dims the C prefill kernel takes (multiples of 32 up to 256).
_PREFILL_HEAD_DIMS = range(32, 257, 32)


@kernel_binding
def _prefill_kernel():
    """`kernels/cpu/prefill_attention.c`'s entry point, None where it is not built for AVX512_BF16."""
    kernel = bind("prefill_attention", "prefill_attention_bf16", _PREFILL_ARGTYPES, ctypes.c_int)
    return kernel if kernel is not None and library_isa("prefill_attention") == "avx512_bf16" else None


def prefill_kernel_takes(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether the C prefill kernel runs this step's chunks: bfloat16 query and caches on
    the CPU, a head dim it has code for, a build with AVX512_BF16."""
    return (query.device.type == "cpu" and query.dtype == key_cache.dtype == torch.bfloat16
            and key_cache.shape[-1] in _PREFILL_HEAD_DIMS and query.shape[1] % key_cache.shape[2] == 0
            and _prefill_kernel() is not None)


def _run_prefill_kernel(query, key_cache, value_cache, native, scale, out) -> None:
    """The C prefill kernel over the plan's requests (`native`: block tables, query starts,
    query lengths, context lengths, int32)."""
    tables, starts, lens, seq_lens = native
    if not (key_cache.is_contiguous() and value_cache.is_contiguous() and heads_packed(query) and heads_packed(out)
            and value_cache.dtype == out.dtype == torch.bfloat16):
        raise ValueError("prefill attention kernel: caches must be contiguous, query/out rows heads-packed bf16")
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    status = _prefill_kernel()(
        query.data_ptr(), query.stride(0), key_cache.data_ptr(), value_cache.data_ptr(), tables.data_ptr(),
        tables.stride(0), starts.data_ptr(), lens.data_ptr(), seq_lens.data_ptr(), len(lens), query.shape[1],
        num_kv_heads, head_dim, block_size, scale, out.data_ptr(), out.stride(0), torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError("prefill attention kernel: out of memory for its K/V copies") if status < 0 else \
            ValueError("prefill attention kernel: shapes it cannot take")
