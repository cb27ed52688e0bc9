"""Ragged paged batches for the attention tests, and dense attention to check them against."""

from dataclasses import dataclass

import torch

from kernels.attention_metadata import AttentionMetadata

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
# (num_heads, num_kv_heads): GQA ratios 1, 3 and 8.
HEAD_CONFIGS = [(32, 32), (24, 8), (32, 4)] if ON_CUDA else [(2, 2), (6, 2), (8, 1)]


@dataclass
class PagedBatch:
    query: torch.Tensor  # [T, nh, hd]
    key_cache: torch.Tensor  # [num_blocks, bs, kvh, hd]
    value_cache: torch.Tensor
    attn: AttentionMetadata
    scale: float

    def args(self) -> tuple:
        return self.query, self.key_cache, self.value_cache, self.attn, self.scale


def make_batch(
    query_lens: list[int],
    context_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    window: int | None = None,
) -> PagedBatch:
    """Random caches, blocks handed out in shuffled order, garbage past each table's end
    and, with a sliding ``window``, garbage for the blocks wholly before each request's
    first query's window (as a kernel must never read them)."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(query_lens, context_lens, strict=True)]
    blocks_needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_needed) + 3
    max_blocks = max(blocks_needed) + 2
    order = torch.randperm(num_blocks, generator=gen)
    # Garbage entries, some out of range: a kernel must never read past seq_len's blocks.
    block_tables = torch.randint(-5, num_blocks + 100, (len(seq_lens), max_blocks), generator=gen)
    used = 0
    for i, n in enumerate(blocks_needed):
        block_tables[i, :n] = order[used : used + n]
        used += n
    if window is not None:
        for i, context in enumerate(context_lens):
            skipped = max(context - window + 1, 0) // block_size
            block_tables[i, :skipped] = torch.randint(num_blocks + 1, num_blocks + 100, (skipped,), generator=gen)
    new_positions = [torch.arange(c, s) for c, s in zip(context_lens, seq_lens)]
    slot_mapping = torch.cat([
        block_tables[i, p // block_size] * block_size + p % block_size for i, p in enumerate(new_positions)
    ])  # fmt: skip
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    starts = torch.tensor([0] + query_lens).cumsum(0)
    return PagedBatch(
        query=torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(DEVICE, dtype),
        key_cache=torch.randn(cache_shape, generator=gen).to(DEVICE, dtype),
        value_cache=torch.randn(cache_shape, generator=gen).to(DEVICE, dtype),
        attn=AttentionMetadata(
            slot_mapping=slot_mapping.to(DEVICE),
            block_tables=block_tables.to(DEVICE, torch.int32),
            query_start_loc=starts.to(DEVICE, torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            sliding_window=window,
        ),
        scale=head_dim**-0.5,
    )


def dense_attention(batch: PagedBatch) -> torch.Tensor:
    """Per request: unpage K/V position by position, causal (and windowed) softmax attention
    in float64."""
    num_heads = batch.query.shape[1]
    block_size, num_kv_heads = batch.key_cache.shape[1], batch.key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty(batch.query.shape, dtype=torch.float64, device=DEVICE)
    starts = batch.attn.query_start_loc.tolist()
    window = batch.attn.sliding_window
    for i, seq_len in enumerate(batch.attn.seq_lens.tolist()):
        num_queries = starts[i + 1] - starts[i]
        first = 0 if window is None else max(seq_len - num_queries - window + 1, 0)
        positions = torch.arange(first, seq_len, device=DEVICE)
        blocks = batch.attn.block_tables[i, positions // block_size].long()
        k = batch.key_cache[blocks, positions % block_size].double()  # [S, kvh, hd]
        v = batch.value_cache[blocks, positions % block_size].double()
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        q = batch.query[starts[i] : starts[i + 1]].double()  # [Lq, nh, hd]
        q_positions = seq_len - q.shape[0] + torch.arange(q.shape[0], device=DEVICE)
        visible = positions[None, :] <= q_positions[:, None]  # [Lq, S]
        if window is not None:
            visible &= positions[None, :] > q_positions[:, None] - window
        for h in range(num_heads):  # one head at a time keeps long prefills small
            scores = (q[:, h] @ k[:, h].T) * batch.scale
            scores = scores.masked_fill(~visible, float("-inf"))
            out[starts[i] : starts[i + 1], h] = scores.softmax(-1) @ v[:, h]
    return out


def mixed_lens(seed: int) -> tuple[list[int], list[int]]:
    """Query and context lengths of a ragged batch: decodes, fresh prefills, later chunks."""
    if not ON_CUDA:
        # decode, prefill, decode at a block edge, chunk after context, 1-token prompt,
        # chunk spanning several query blocks.
        return [1, 13, 1, 9, 1, 37], [37, 0, 15, 23, 0, 30]
    gen = torch.Generator().manual_seed(seed)
    query_lens = [1] * 24 + torch.randint(2, 300, (8,), generator=gen).tolist()
    context_lens = torch.randint(0, 1500, (32,), generator=gen).tolist()
    order = torch.randperm(32, generator=gen).tolist()
    return [query_lens[j] for j in order], [context_lens[j] for j in order]


def poisoned_out(query: torch.Tensor) -> torch.Tensor:
    return torch.full_like(query, float("nan"))
