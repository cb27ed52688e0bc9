"""Paged attention over block tables for a mixed batch of prefill chunks and decodes.

The worker calls this once per layer after `write_kv` has put the step's new K/V into the
paged cache. Request i owns query tokens query_start_loc[i]:query_start_loc[i+1] and a
context of seq_lens[i] tokens (its new tokens included); its token j sits at position
seq_lens[i] - q_len_i + j and attends causally to cache positions 0..that position, read
through block_tables[i]. GQA: query head h reads kv head h // (num_heads // num_kv_heads).

`paged_attention_ref` is the PyTorch reference and the CPU production path (gather + one
SDPA call per query-length bucket); `paged_attention_triton` is the GPU kernel (one launch,
online softmax, grid over request x query block x kv head).
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


def _gather_kv(
    cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, max_len: int
) -> torch.Tensor:
    """Cache [num_blocks, bs, kvh, hd] -> [N, kvh, max_len, hd] through each request's blocks."""
    block_size = cache.shape[1]
    num_blocks = triton.cdiv(max_len, block_size)
    blocks = block_tables[:, :num_blocks].long()
    # Table entries past a request's last block may be garbage (even out of range): use block 0.
    needed = (seq_lens.long() + block_size - 1) // block_size
    in_use = torch.arange(num_blocks, device=blocks.device) < needed[:, None]
    blocks = torch.where(in_use, blocks, 0)
    kv = cache[blocks].flatten(1, 2)[:, :max_len]
    return kv.transpose(1, 2)


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
) -> torch.Tensor:
    """query [T, nh, hd] -> out [T, nh, hd]; see the module docstring for the layout.

    Cache slots that no request reads (past seq_len in a request's last block) must hold
    finite values (zeros or old K/V), as 0 * NaN would leak into the padded SDPA.
    """
    out = torch.empty_like(query)
    if query.shape[0] == 0:
        return out
    seq_lens = seq_lens.long()
    query_start_loc = query_start_loc.long()
    query_starts = query_start_loc[:-1]
    query_lens = query_start_loc[1:] - query_starts
    if max_query_len == 1:
        # Decode-only batch: one group, no bucketing.
        _attend_group(
            query, key_cache, value_cache, block_tables, query_starts, query_lens,
            seq_lens, scale, 1, max_seq_len, out,
        )  # fmt: skip
        return out
    # Padding every request to the batch's longest query would cost O(B * max_query_len),
    # e.g. 128 decodes next to one 2k-token chunk; bucketing requests by the power of two
    # of their query length bounds the padding to 2x per bucket, in a few SDPA calls.
    buckets = torch.ceil(torch.log2(query_lens.clamp(min=1).double())).long()
    for bucket in torch.unique(buckets).tolist():
        reqs = torch.nonzero(buckets == bucket).squeeze(1)
        group_query_lens = query_lens[reqs]
        group_seq_lens = seq_lens[reqs]
        _attend_group(
            query, key_cache, value_cache, block_tables[reqs], query_starts[reqs],
            group_query_lens, group_seq_lens, scale, int(group_query_lens.max()),
            int(group_seq_lens.max()), out,
        )  # fmt: skip
    return out
