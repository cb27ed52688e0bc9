"""Paged attention over block tables for a mixed batch of prefill chunks and decodes, in Triton.

The "triton" backend's attention, with the contract of the PyTorch reference
`paged_attention_ref` in `kernels.paged_attention_torch` (see that module for the batch
layout and the causal and GQA rules; `tests/kernels/test_paged_attention.py` compares
the two). `paged_attention_triton` is the GPU kernel: one launch, online softmax, grid
over request x query block x kv head; for decode batches too small to fill the GPU it
also splits each sequence's keys among programs (flash-decoding) and merges the partial
softmaxes in a second small launch. With a sliding window a program starts at its first
query's window: keys before it are never read.
"""

import functools

import torch

from kernels.attention_metadata import AttentionMetadata
from kernels.triton_import import OutOfResources, tl, triton


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
    window,  # SLIDING: each query sees its last `window` positions
    SLIDING: tl.constexpr,
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

    # The keys any row of this query block may see (from the first row's window start, on a
    # tile boundary, to one past the last row), and this split's share.
    kv_end = tl.minimum(context_len + (q_block + 1) * BLOCK_Q, seq_len)
    kv_start = 0
    window_start = 0  # the first key the block's first row sees: the table says nothing of earlier ones
    if SLIDING:
        window_start = tl.maximum(context_len + q_block * BLOCK_Q - window + 1, 0)
        kv_start = window_start // BLOCK_N * BLOCK_N
    tiles_per_split = tl.cdiv(tl.cdiv(kv_end - kv_start, BLOCK_N), NUM_SPLITS)
    kv_lo = kv_start + split * tiles_per_split * BLOCK_N
    kv_hi = tl.minimum(kv_end, kv_lo + tiles_per_split * BLOCK_N)
    block_table = block_tables_ptr + req.to(tl.int64) * block_table_stride
    kv_head_offset = kv_head.to(tl.int64) * cache_head_stride
    for start in range(kv_lo, kv_hi, BLOCK_N):
        positions = start + tl.arange(0, BLOCK_N)
        key_valid = (positions < kv_hi) & (positions >= window_start)
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
        if SLIDING:
            visible = visible & (positions[None, :] > q_position[:, None] - window)
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


# (head_dim, dtype) whose 128-key decode tile the GPU could not hold (shared memory): 64 then.
_DECODE_TILE_TOO_BIG: set[tuple[int, torch.dtype]] = set()
BASE_KEYS_PER_TILE = 64


def _keys_per_tile(head_dim: int, max_query_len: int, dtype: torch.dtype) -> int:
    """Keys per inner-loop tile. A decode program is latency-bound (a block-table load, then
    K, then V, one tile after another), so decode batches take 128 keys a tile: on an H200
    at batch 32 with 1k contexts that moved decode attention from 19/42/60% of copy bandwidth
    to 27/57/77% for SmolLM2-135M's, Llama-3.2-1B's and Llama-3-8B's heads (docs/BENCHMARKS-
    diary.md, "The first real run"). A GPU with less shared memory may not hold that tile
    with Triton's pipelining: its first launch falls back to 64 (``_DECODE_TILE_TOO_BIG``).
    Prefill tiles hold 64 query rows: they keep 64 keys, not measured larger; past 128
    dims, 32."""
    if head_dim > 128:
        return 32
    if max_query_len == 1 and (head_dim, dtype) not in _DECODE_TILE_TOO_BIG:
        return 128
    return BASE_KEYS_PER_TILE


def paged_attention_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    attn: AttentionMetadata,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Triton paged attention, one launch for the whole mixed batch; same contract as the ref.

    num_splits (a power of two) splits each sequence's keys among that many programs, merged
    by a second small launch; None chooses it from the batch shape (see _choose_num_splits).
    block_n (keys per inner-loop tile; None: _keys_per_tile's choice), num_warps and
    num_stages (None: Triton's default) are the launch's tuning, for the GPU check's sweep.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    assert query.stride(-1) == 1 and key_cache.stride(-1) == 1
    assert key_cache.stride() == value_cache.stride()
    if out is None:
        out = torch.empty_like(query)
    assert out.shape == query.shape and out.stride(-1) == 1
    max_query_len, max_seq_len = attn.max_query_len, attn.max_seq_len
    num_reqs = attn.seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return out
    group = num_heads // num_kv_heads
    # Decodes want one query token per program (rows = the GQA group); prefill chunks want
    # enough tokens to fill a 64-row tile of the tensor core MMA.
    rows = 16 if max_query_len == 1 else 64
    block_q = max(1, min(rows // group, max_query_len))
    block_m = max(16, triton.next_power_of_2(block_q * group))
    window = attn.sliding_window
    if num_splits is None:
        keys = max_seq_len if window is None else min(max_seq_len, window + max_query_len)
        num_splits = _choose_num_splits(query, num_reqs, num_kv_heads, max_query_len, keys)
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
    keys_per_tile = block_n or _keys_per_tile(head_dim, max_query_len, query.dtype)
    launch = functools.partial(
        _paged_attention_kernel[grid],
        out,
        partial,
        partial_max,
        partial_sum,
        query,
        key_cache,
        value_cache,
        attn.block_tables,
        attn.query_start_loc,
        attn.seq_lens,
        scale * 1.4426950408889634,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        attn.block_tables.stride(0),
        key_cache.shape[1],
        num_heads,
        head_dim,
        window or 0,
        SLIDING=window is not None,
        NUM_SPLITS=num_splits,
        GROUP=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        HEAD_DIM=head_dim_padded,
        INPUT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        **({} if num_stages is None else {"num_stages": num_stages}),
    )
    try:
        launch(BLOCK_N=keys_per_tile)
    except OutOfResources:
        if block_n is not None or keys_per_tile == BASE_KEYS_PER_TILE:
            raise
        _DECODE_TILE_TOO_BIG.add((head_dim, query.dtype))
        launch(BLOCK_N=BASE_KEYS_PER_TILE)
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
