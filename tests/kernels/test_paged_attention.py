"""Paged attention: the PyTorch reference against dense attention on unpaged K/V, and the
Triton kernel against the reference, on ragged mixed prefill/decode batches."""

from dataclasses import dataclass

import pytest
import torch

from kernels.paged_attention import paged_attention_ref, paged_attention_triton

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
# (num_heads, num_kv_heads): GQA ratios 1, 3 and 8.
HEAD_CONFIGS = [(32, 32), (24, 8), (32, 4)] if ON_CUDA else [(2, 2), (6, 2), (8, 1)]
# Under TRITON_INTERPRET=1, tl.dot on bf16 reinterprets the bits (numpy has no bf16), so bf16
# runs only on CUDA; fp16 covers the half-precision path on CPU.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_CUDA else [])
TOLERANCES = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


@dataclass
class PagedBatch:
    query: torch.Tensor  # [T, nh, hd]
    key_cache: torch.Tensor  # [num_blocks, bs, kvh, hd]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    max_query_len: int
    max_seq_len: int
    scale: float

    def args(self) -> tuple:
        return (
            self.query, self.key_cache, self.value_cache, self.block_tables,
            self.query_start_loc, self.seq_lens, self.scale, self.max_query_len,
            self.max_seq_len,
        )  # fmt: skip


def make_batch(
    query_lens: list[int],
    context_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> PagedBatch:
    """Random caches, blocks handed out in shuffled order, garbage past each table's end."""
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
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    starts = torch.tensor([0] + query_lens).cumsum(0)
    return PagedBatch(
        query=torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(DEVICE, dtype),
        key_cache=torch.randn(cache_shape, generator=gen).to(DEVICE, dtype),
        value_cache=torch.randn(cache_shape, generator=gen).to(DEVICE, dtype),
        block_tables=block_tables.to(DEVICE, torch.int32),
        query_start_loc=starts.to(DEVICE, torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        scale=head_dim**-0.5,
    )


def dense_attention(batch: PagedBatch) -> torch.Tensor:
    """Per request: unpage K/V position by position, causal softmax attention in float64."""
    num_heads = batch.query.shape[1]
    block_size, num_kv_heads = batch.key_cache.shape[1], batch.key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty(batch.query.shape, dtype=torch.float64, device=DEVICE)
    starts = batch.query_start_loc.tolist()
    for i, seq_len in enumerate(batch.seq_lens.tolist()):
        positions = torch.arange(seq_len, device=DEVICE)
        blocks = batch.block_tables[i, positions // block_size].long()
        k = batch.key_cache[blocks, positions % block_size].double()  # [S, kvh, hd]
        v = batch.value_cache[blocks, positions % block_size].double()
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        q = batch.query[starts[i] : starts[i + 1]].double()  # [Lq, nh, hd]
        q_positions = seq_len - q.shape[0] + torch.arange(q.shape[0], device=DEVICE)
        visible = positions[None, :] <= q_positions[:, None]  # [Lq, S]
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


@pytest.mark.parametrize("num_heads,num_kv_heads", HEAD_CONFIGS)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_reference_matches_dense_attention(num_heads, num_kv_heads, head_dim):
    query_lens, context_lens = mixed_lens(seed=head_dim)
    batch = make_batch(query_lens, context_lens, num_heads, num_kv_heads, head_dim, seed=1)
    out = paged_attention_ref(*batch.args(), out=poisoned_out(batch.query))
    torch.testing.assert_close(out.double(), dense_attention(batch), rtol=1e-5, atol=1e-5)


def test_reference_decode_only_batch():
    batch = make_batch([1] * 5, [0, 15, 16, 17, 40], 6, 2, 64, block_size=8, seed=2)
    out = paged_attention_ref(*batch.args(), out=poisoned_out(batch.query))
    torch.testing.assert_close(out.double(), dense_attention(batch), rtol=1e-5, atol=1e-5)


def test_reference_skips_requests_without_query_tokens():
    # A request with no token this step must not write into its neighbour's rows.
    batch = make_batch([1, 0, 1, 5, 0], [20, 9, 3, 4, 30], 6, 2, 64, block_size=8, seed=4)
    out = paged_attention_ref(*batch.args(), out=poisoned_out(batch.query))
    torch.testing.assert_close(out.double(), dense_attention(batch), rtol=1e-5, atol=1e-5)


def test_reference_bfloat16_decodes():
    batch = make_batch([1] * 6, [0, 7, 16, 31, 64, 100], 9, 3, 64, dtype=torch.bfloat16, seed=5)
    out = paged_attention_ref(*batch.args(), out=poisoned_out(batch.query))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), dense_attention(batch), rtol=2e-2, atol=2e-2)


def test_decode_plan_is_rebuilt_when_the_metadata_changes():
    # Each layer of a step passes the same metadata tensors, and the decode plan built
    # for the first is reused; a change in place (or new tensors) must rebuild it.
    batch = make_batch([1] * 4, [5, 17, 30, 2], 6, 2, 64, block_size=8, seed=7)
    first = paged_attention_ref(*batch.args(), out=poisoned_out(batch.query))
    torch.testing.assert_close(first.double(), dense_attention(batch), rtol=1e-5, atol=1e-5)
    again = paged_attention_ref(*batch.args(), out=poisoned_out(batch.query))
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    # The same tensors changed in place: one key fewer each...
    batch.seq_lens -= 1
    batch.max_seq_len -= 1
    out = paged_attention_ref(*batch.args(), out=poisoned_out(batch.query))
    torch.testing.assert_close(out.double(), dense_attention(batch), rtol=1e-5, atol=1e-5)
    # ...then two requests trade their blocks and lengths.
    batch.block_tables[[0, 2]] = batch.block_tables[[2, 0]]
    batch.seq_lens[[0, 2]] = batch.seq_lens[[2, 0]]
    out = paged_attention_ref(*batch.args(), out=poisoned_out(batch.query))
    torch.testing.assert_close(out.double(), dense_attention(batch), rtol=1e-5, atol=1e-5)


def test_reference_long_single_prefill():
    # SmolLM2-135M heads; 2000 tokens must not need a [T, T] per head in padded form.
    batch = make_batch([2000], [0], 9, 3, 64, seed=3)
    out = paged_attention_ref(*batch.args(), out=poisoned_out(batch.query))
    torch.testing.assert_close(out.double(), dense_attention(batch), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_heads,num_kv_heads", HEAD_CONFIGS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_matches_reference(num_heads, num_kv_heads, head_dim, dtype):
    query_lens, context_lens = mixed_lens(seed=head_dim + num_kv_heads)
    batch = make_batch(
        query_lens, context_lens, num_heads, num_kv_heads, head_dim, dtype=dtype, seed=4
    )
    expected = paged_attention_ref(*batch.args())
    out = paged_attention_triton(*batch.args(), out=poisoned_out(batch.query))
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("block_size", [8, 16])
def test_triton_decode_only_batch(block_size):
    context_lens = [0, 7, 8, 9, 100] if not ON_CUDA else list(range(0, 4096, 61))
    batch = make_batch([1] * len(context_lens), context_lens, 8, 1, 128, block_size, seed=5)
    expected = paged_attention_ref(*batch.args())
    out = paged_attention_triton(*batch.args(), out=poisoned_out(batch.query))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_triton_returns_new_tensor_in_query_dtype():
    batch = make_batch([3, 1], [0, 5], 2, 2, 64, dtype=torch.float16, seed=6)
    out = paged_attention_triton(*batch.args())
    assert out.shape == batch.query.shape and out.dtype == torch.float16
    torch.testing.assert_close(out, paged_attention_ref(*batch.args()), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("num_splits", [2, 4])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEAD_CONFIGS[1:])
def test_triton_split_kv_matches_reference(num_splits, num_heads, num_kv_heads):
    # Decodes, plus a chunk with context: some splits see no key for its early rows.
    context_lens = [0, 3, 70, 129, 40] if not ON_CUDA else [0, 3, 700, 4000, 1200]
    query_lens = [1, 1, 1, 1, 17]
    batch = make_batch(query_lens, context_lens, num_heads, num_kv_heads, 64, seed=7)
    expected = paged_attention_ref(*batch.args())
    out = paged_attention_triton(
        *batch.args(), out=poisoned_out(batch.query), num_splits=num_splits
    )
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_triton_head_dim_not_power_of_two(num_splits):
    batch = make_batch([1, 6, 1], [20, 9, 0], 4, 2, 80, seed=8)
    expected = paged_attention_ref(*batch.args())
    out = paged_attention_triton(
        *batch.args(), out=poisoned_out(batch.query), num_splits=num_splits
    )
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
