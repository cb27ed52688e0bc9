"""Paged attention over block tables for a mixed batch of prefill chunks and decodes.

The worker calls this once per layer after `write_kv` has put the step's new K/V into the
paged cache. Request i owns query tokens query_start_loc[i]:query_start_loc[i+1] and a
context of seq_lens[i] tokens (its new tokens included); its token j sits at position
seq_lens[i] - q_len_i + j and attends causally to cache positions 0..that position, read
through block_tables[i]. GQA: query head h reads kv head h // (num_heads // num_kv_heads).

`paged_attention_ref` is the PyTorch reference, and the CPU path wherever
`kernels.cpu_paged_attention`'s C decode kernel does not apply: decodes read
their blocks with one `index_select` and attend with batched matmuls straight on the
cache's [token, kv head, dim] rows (no transposed copy of K/V: that copy, not the
arithmetic, is what a padded SDPA call spends its time on at decode); what an all-decode
step's layers share (block list, key mask, query rows) is built once for the step; prefill
chunks go through one padded SDPA call per query-length bucket. `paged_attention_triton` is the GPU kernel (one launch,
online softmax, grid over request x query block x kv head), which for decode batches too
small to fill the GPU also splits each sequence's keys among programs (flash-decoding) and
merges the partial softmaxes in a second small launch.
"""

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.triton_import import tl, triton


def _gather_kv(
    cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, max_len: int
) -> torch.Tensor:
    """Cache [num_blocks, bs, kvh, hd] -> [N, kvh, max_len, hd] through each request's blocks."""
    block_size = cache.shape[1]
    num_blocks = -(-max_len // block_size)
    blocks = block_tables[:, :num_blocks].long()
    # Table entries past a request's last block may be garbage (even out of range): use block 0.
    needed = (seq_lens.long() + block_size - 1) // block_size
    in_use = torch.arange(num_blocks, device=blocks.device) < needed[:, None]
    blocks = torch.where(in_use, blocks, 0)
    kv = cache[blocks].flatten(1, 2)[:, :max_len]
    return kv.transpose(1, 2)


@dataclass
class _DecodePlan:
    """What every layer's decode attention shares within one step, built once per step."""

    blocks: torch.Tensor  # [n * num_blocks] int64: each request's blocks, in order
    span: int  # num_blocks * block_size: keys read per request
    bias: torch.Tensor  # [n, 1, span] float32: 0 for visible keys, -inf past seq_len
    query_rows: torch.Tensor | None  # [n] int64 rows of `query`; None: row i is request i


def _decode_plan(
    block_tables: torch.Tensor, query_starts: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int, block_size: int
) -> _DecodePlan:
    n = seq_lens.shape[0]
    seq_lens = seq_lens.long()
    num_blocks = -(-max_seq_len // block_size)
    blocks = block_tables[:, :num_blocks].long()
    needed = (seq_lens + block_size - 1) // block_size
    # Table entries past a request's last block may be garbage (even out of range): use block 0.
    blocks = torch.where(torch.arange(num_blocks, device=blocks.device) < needed[:, None], blocks, 0).flatten()
    span = num_blocks * block_size
    hidden = torch.arange(span, device=seq_lens.device)[None, :] >= seq_lens[:, None]
    bias = torch.zeros(n, 1, span, device=seq_lens.device).masked_fill_(hidden[:, None, :], float("-inf"))
    identity = query_starts.shape[0] == n and bool(
        (query_starts == torch.arange(n, device=query_starts.device)).all()
    )
    return _DecodePlan(blocks, span, bias, None if identity else query_starts.long())


class _PlanMemo:
    """The plan of the last all-decode step, reused while the same metadata tensors (the
    same objects, not modified in place since) come back, as they do from each layer of
    a model; None when that step's batch is not all decodes.

    In-place changes are seen through tensors' version counters, which inference-mode
    tensors lack: there, new metadata must come as new tensors (the model runner builds
    them anew each step)."""

    def __init__(self) -> None:
        # (metadata tensors, key, plan), replaced whole; the strong references keep any
        # other tensor from taking these objects' identities.
        self._entry: tuple | None = None

    def get(
        self, block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
        max_seq_len: int, block_size: int,
    ) -> _DecodePlan | None:  # fmt: skip
        sources = (block_tables, query_start_loc, seq_lens)
        key = (max_seq_len, block_size, *(0 if t.is_inference() else t._version for t in sources))
        entry = self._entry
        if entry is not None and entry[1] == key and all(a is b for a, b in zip(entry[0], sources)):
            return entry[2]
        query_starts = query_start_loc[:-1].long()
        all_decodes = bool((query_start_loc[1:].long() - query_starts == 1).all())
        plan = _decode_plan(block_tables, query_starts, seq_lens, max_seq_len, block_size) if all_decodes else None
        self._entry = (sources, key, plan)
        return plan


_DECODE_PLANS = _PlanMemo()


@functools.lru_cache(maxsize=16)
def _head_selector(num_kv_heads: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[1, kvh, 1, kvh, 1]: 1 where a query head's KV head meets its own columns."""
    eye = torch.eye(num_kv_heads, dtype=dtype, device=device)
    return eye.view(1, num_kv_heads, 1, num_kv_heads, 1)


def _attend_decodes(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: _DecodePlan,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Requests with one query token each; writes their rows of `out`."""
    n = plan.bias.shape[0]
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads
    span = plan.span
    k = key_cache.index_select(0, plan.blocks).view(n, span, num_kv_heads * head_dim)
    v = value_cache.index_select(0, plan.blocks).view(n, span, num_kv_heads * head_dim)
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
    max_query_len: int,
    max_seq_len: int,
    out: torch.Tensor,
) -> None:
    """One padded SDPA call for a group of requests; writes their rows of `out`."""
    device = query.device
    q_offsets = torch.arange(max_query_len, device=device)
    k_offsets = torch.arange(max_seq_len, device=device)
    is_real = q_offsets[None, :] < query_lens[:, None]  # [N, Lq]
    tokens = torch.where(is_real, query_starts[:, None] + q_offsets, 0)
    q = query[tokens].transpose(1, 2)  # [N, nh, Lq, hd]
    k = _gather_kv(key_cache, block_tables, seq_lens, max_seq_len)
    v = _gather_kv(value_cache, block_tables, seq_lens, max_seq_len)
    # Causal over absolute positions; padded query rows see at least key 0, so no row is all
    # masked (which would give NaN). Keys past seq_len are never visible to a real row.
    q_positions = (seq_lens - query_lens)[:, None] + q_offsets  # [N, Lq]
    mask = k_offsets[None, None, :] <= q_positions[:, :, None]  # [N, Lq, S]
    o = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask[:, None], scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    out[tokens[is_real]] = o.transpose(1, 2)[is_real]


def paged_attention_ref(
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
    """query [T, nh, hd] -> out [T, nh, hd]; see the module docstring for the layout.

    `out`, if given, is a preallocated [T, nh, hd] tensor the result is written into.

    The caches must hold finite values everywhere (zeros or old K/V, never torch.empty
    garbage): masked padding keys still enter the padded SDPA, and 0 * NaN is NaN.
    """
    if out is None:
        out = torch.empty_like(query)
    if query.shape[0] == 0:
        return out
    block_size = key_cache.shape[1]
    if max_query_len == 1:
        plan = _DECODE_PLANS.get(block_tables, query_start_loc, seq_lens, max_seq_len, block_size)
        if plan is not None:
            _attend_decodes(query, key_cache, value_cache, plan, scale, out)
            return out
    seq_lens = seq_lens.long()
    query_start_loc = query_start_loc.long()
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
        if bucket == 0:  # one query token each
            plan = _decode_plan(
                block_tables[reqs], query_starts[reqs], group_seq_lens, int(group_seq_lens.max()), block_size
            )
            _attend_decodes(query, key_cache, value_cache, plan, scale, out)
            continue
        _attend_group(
            query, key_cache, value_cache, block_tables[reqs], query_starts[reqs],
            group_query_lens, group_seq_lens, scale, int(group_query_lens.max()),
            int(group_seq_lens.max()), out,
        )  # fmt: skip
    return out


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    partial_ptr,  # split-KV only: fp32 [T, nh, NUM_SPLITS, HEAD_DIM] unnormalised outputs
    partial_max_ptr,  # split-KV only: fp32 [T, nh, NUM_SPLITS] running max (log2 domain)
    partial_sum_ptr,  # split-KV only: fp32 [T, nh, NUM_SPLITS] softmax denominators
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    scale_log2,  # softmax scale * log2(e): the kernel works with exp2
    query_token_stride,
    query_head_stride,
    out_token_stride,
    out_head_stride,
    cache_block_stride,
    cache_slot_stride,
    cache_head_stride,
    block_table_stride,
    block_size,
    num_heads,
    head_dim,
    NUM_SPLITS: tl.constexpr,  # programs sharing one (request, query block, kv head)
    GROUP: tl.constexpr,  # query heads per kv head
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # next power of two >= BLOCK_Q * GROUP, at least 16
    BLOCK_N: tl.constexpr,  # keys per inner-loop tile
    HEAD_DIM: tl.constexpr,  # head_dim rounded up to a power of two
    INPUT_PRECISION: tl.constexpr,
):
    # One program: request `req`, its query tokens [q_block*BLOCK_Q, +BLOCK_Q), and the GROUP
    # query heads sharing kv head `kv_head`, flattened into BLOCK_M rows (token-major), so
    # each K/V tile is loaded once for the whole group. With NUM_SPLITS > 1 the keys are
    # shared out among NUM_SPLITS programs (flash-decoding), merged by _merge_splits_kernel.
    req = tl.program_id(0)
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS

    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_index = q_block * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (q_index < q_len)
    q_position = context_len + q_index
    dims = tl.arange(0, HEAD_DIM)
    dim_valid = dims < head_dim

    token = (q_start + q_index).to(tl.int64)
    q = tl.load(
        query_ptr + token[:, None] * query_token_stride + head[:, None] * query_head_stride
        + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )  # fmt: skip

    # Finite start for the running max, so rows with every key masked give p = 0, not NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # One past the last key any row of this query block may see, and this split's share.
    kv_end = tl.minimum(context_len + (q_block + 1) * BLOCK_Q, seq_len)
    tiles_per_split = tl.cdiv(tl.cdiv(kv_end, BLOCK_N), NUM_SPLITS)
    kv_lo = split * tiles_per_split * BLOCK_N
    kv_hi = tl.minimum(kv_end, kv_lo + tiles_per_split * BLOCK_N)
    block_table = block_tables_ptr + req.to(tl.int64) * block_table_stride
    kv_head_offset = kv_head.to(tl.int64) * cache_head_stride
    for start in range(kv_lo, kv_hi, BLOCK_N):
        positions = start + tl.arange(0, BLOCK_N)
        key_valid = positions < kv_hi
        block = tl.load(block_table + positions // block_size, mask=key_valid, other=0)
        slot_offset = (
            block.to(tl.int64) * cache_block_stride
            + (positions % block_size) * cache_slot_stride
            + kv_head_offset
        )
        k = tl.load(  # [HEAD_DIM, BLOCK_N]
            key_cache_ptr + slot_offset[None, :] + dims[:, None],
            mask=dim_valid[:, None] & key_valid[None, :],
            other=0.0,
        )
        s = tl.dot(q, k, input_precision=INPUT_PRECISION) * scale_log2
        visible = key_valid[None, :] & (positions[None, :] <= q_position[:, None])
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(  # [BLOCK_N, HEAD_DIM]
            value_cache_ptr + slot_offset[:, None] + dims[None, :],
            mask=key_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(
            p.to(v.dtype), v, input_precision=INPUT_PRECISION
        )
        m_i = m_new

    store_mask = row_valid[:, None] & dim_valid[None, :]
    if NUM_SPLITS == 1:
        acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + token[:, None] * out_token_stride + head[:, None] * out_head_stride
            + dims[None, :],
            acc.to(out_ptr.dtype.element_ty),
            mask=store_mask,
        )  # fmt: skip
    else:
        # A split with no visible key leaves max = -1e30, sum = 0, acc = 0: weight 0 in the merge.
        partial = (token * num_heads + head) * NUM_SPLITS + split
        tl.store(partial_max_ptr + partial, m_i, mask=row_valid)
        tl.store(partial_sum_ptr + partial, l_i, mask=row_valid)
        # All HEAD_DIM columns (padding ones are 0), as the merge reads them unmasked.
        tl.store(
            partial_ptr + partial[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_valid[:, None]
        )


@triton.jit
def _merge_splits_kernel(
    out_ptr,
    partial_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    out_token_stride,
    out_head_stride,
    num_heads,
    head_dim,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    # One program per (token, query head): rescale each split's partial softmax to the
    # common max and normalise once.
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    partial = (token * num_heads + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, HEAD_DIM)
    m = tl.load(partial_max_ptr + partial)
    weight = tl.exp2(m - tl.max(m, axis=0))
    denominator = tl.sum(tl.load(partial_sum_ptr + partial) * weight, axis=0)
    acc = tl.load(partial_ptr + partial[:, None] * HEAD_DIM + dims[None, :])
    out = tl.sum(acc * weight[:, None], axis=0) / denominator
    tl.store(
        out_ptr + token * out_token_stride + head * out_head_stride + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < head_dim,
    )


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _choose_num_splits(
    query: torch.Tensor, num_reqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int
) -> int:
    """Split the keys of decode-only batches too small to fill the GPU (e.g. 1 request, 32k)."""
    if not query.is_cuda or max_query_len > 1 or max_seq_len < 2048:
        return 1
    programs = num_reqs * num_kv_heads
    sms = _num_sms(query.device.index or 0)
    if programs >= sms:
        return 1
    # About 2 programs per SM, each with at least 1024 keys, rounded down to a power of two
    # (the merge kernel's tl.arange needs one).
    wanted = min(triton.cdiv(2 * sms, programs), max_seq_len // 1024, 64)
    return 1 << (wanted.bit_length() - 1)


def paged_attention_triton(
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
    num_splits: int | None = None,
) -> torch.Tensor:
    """Triton paged attention, one launch for the whole mixed batch; same contract as the ref.

    num_splits (a power of two) splits each sequence's keys among that many programs, merged
    by a second small launch; None chooses it from the batch shape (see _choose_num_splits).
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    assert query.stride(-1) == 1 and key_cache.stride(-1) == 1
    assert key_cache.stride() == value_cache.stride()
    if out is None:
        out = torch.empty_like(query)
    assert out.shape == query.shape and out.stride(-1) == 1
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return out
    group = num_heads // num_kv_heads
    # Decodes want one query token per program (rows = the GQA group); prefill chunks want
    # enough tokens to fill a 64-row tile of the tensor core MMA.
    rows = 16 if max_query_len == 1 else 64
    block_q = max(1, min(rows // group, max_query_len))
    block_m = max(16, triton.next_power_of_2(block_q * group))
    if num_splits is None:
        num_splits = _choose_num_splits(
            query, num_reqs, num_kv_heads, max_query_len, max_seq_len
        )
    assert num_splits >= 1 and num_splits & (num_splits - 1) == 0, "num_splits: a power of 2"
    head_dim_padded = max(16, triton.next_power_of_2(head_dim))
    if num_splits > 1:
        partial_sum = torch.empty(
            (num_tokens, num_heads, num_splits), dtype=torch.float32, device=query.device
        )
        partial_max = torch.empty_like(partial_sum)
        partial = partial_sum.new_empty((num_tokens, num_heads, num_splits, head_dim_padded))
    else:
        partial = partial_max = partial_sum = out  # unused
    grid = (num_reqs, triton.cdiv(max_query_len, block_q), num_kv_heads * num_splits)
    _paged_attention_kernel[grid](
        out,
        partial,
        partial_max,
        partial_sum,
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        scale * 1.4426950408889634,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        key_cache.shape[1],
        num_heads,
        head_dim,
        NUM_SPLITS=num_splits,
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=64 if head_dim <= 128 else 32,
        HEAD_DIM=head_dim_padded,
        INPUT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=4,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out,
            partial,
            partial_max,
            partial_sum,
            out.stride(0),
            out.stride(1),
            num_heads,
            head_dim,
            NUM_SPLITS=num_splits,
            HEAD_DIM=head_dim_padded,
        )
    return out
