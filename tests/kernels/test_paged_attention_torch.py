"""Paged attention on the CPU: the PyTorch reference against dense attention on unpaged
K/V, with its decode plan built once per step; decode batches through the C kernel
against dense attention and the reference; what the kernel cannot take goes to the
reference. The batch-invariant attention: every token's result bit for bit the same
whatever the rest of the step and however its prompt was chunked."""

import dataclasses
import functools

import pytest
import torch

import kernels.paged_attention_torch as torch_attention
from kernels.paged_attention_torch import (
    decode_attention_native,
    native_decode_available,
    paged_attention_cpu,
    paged_attention_cpu_batch_invariant,
    paged_attention_ref,
)
from shared.cpu_features import cpu_flags
from tests.kernels.paged_batch import HEAD_CONFIGS, dense_attention, make_batch, mixed_lens, poisoned_out

needs_c_kernel = pytest.mark.skipif(
    not native_decode_available(torch.float32), reason="no C compiler: the C kernel cannot be built here"
)

# (num_heads, num_kv_heads, head_dim): GQA groups 1, 3 (SmolLM2) and 8; the specialised
# head dims 64 and 128, and 80 through the generic code.
SHAPES = [(4, 4, 64), (9, 3, 64), (16, 2, 128), (6, 2, 80)]


def decode_batch(context_lens, shape, dtype, block_size=16, seed=0):
    num_heads, num_kv_heads, head_dim = shape
    return make_batch([1] * len(context_lens), context_lens, num_heads, num_kv_heads, head_dim,
                      block_size=block_size, dtype=dtype, seed=seed)  # fmt: skip


# ------------------------------------------------------------------ the reference


@pytest.mark.parametrize("num_heads,num_kv_heads", HEAD_CONFIGS)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_reference_matches_dense_attention(num_heads, num_kv_heads, head_dim):
    query_lens, context_lens = mixed_lens(seed=head_dim)
    batch = make_batch(query_lens, context_lens, num_heads, num_kv_heads, head_dim, seed=1)
    out = paged_attention_ref(*batch.args(), out=poisoned_out(batch.query))
    torch.testing.assert_close(out.double(), dense_attention(batch), rtol=1e-5, atol=1e-5)
    assert batch.attn.decode_plan is None  # a step with prompt chunks has no step-wide plan


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


def test_decode_plan_is_built_once_per_step():
    # The first layer of an all-decode step builds the plan into the step's metadata;
    # the next layers, with their own queries and caches, reuse it.
    batch = make_batch([1] * 4, [5, 17, 30, 2], 6, 2, 64, block_size=8, seed=7)
    assert batch.attn.decode_plan is None
    out = paged_attention_ref(*batch.args(), out=poisoned_out(batch.query))
    torch.testing.assert_close(out.double(), dense_attention(batch), rtol=1e-5, atol=1e-5)
    plan = batch.attn.decode_plan
    assert plan is not None
    batch.query, batch.key_cache, batch.value_cache = (
        torch.randn_like(t) for t in (batch.query, batch.key_cache, batch.value_cache)
    )
    out = paged_attention_ref(*batch.args(), out=poisoned_out(batch.query))
    assert batch.attn.decode_plan is plan
    torch.testing.assert_close(out.double(), dense_attention(batch), rtol=1e-5, atol=1e-5)


def test_reference_long_single_prefill():
    # SmolLM2-135M heads; 2000 tokens must not need a [T, T] per head in padded form.
    batch = make_batch([2000], [0], 9, 3, 64, seed=3)
    out = paged_attention_ref(*batch.args(), out=poisoned_out(batch.query))
    torch.testing.assert_close(out.double(), dense_attention(batch), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ the C decode kernel


@needs_c_kernel
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block_size", [16, 8])
def test_float32_decodes_match_dense_attention(shape, block_size, cpu_isa):
    # Lengths at block edges (15, 16, 17), a first token (context 0) and a long context.
    batch = decode_batch([0, 15, 16, 17, 40, 300], shape, torch.float32, block_size, seed=1)
    out = paged_attention_cpu(*batch.args(), out=poisoned_out(batch.query))
    torch.testing.assert_close(out.double(), dense_attention(batch), rtol=1e-5, atol=1e-5)


@needs_c_kernel
@pytest.mark.parametrize("shape", [*SHAPES, (16, 1, 64)])
@pytest.mark.parametrize("block_size", [16, 8, 32])
def test_bfloat16_decodes_match_the_reference(shape, block_size, cpu_isa):
    # bf16 takes the AVX512_BF16 paths where compiled in: scores over runs of up to 16
    # tokens inside a block (whole 16-token blocks, halves of 32-token blocks, 8-token
    # blocks), values in registers for head dim 64; head dim 80 and a GQA group of 16 take
    # the generic code.
    batch = decode_batch([3, 31, 64, 100, 513], shape, torch.bfloat16, block_size, seed=2)
    out = paged_attention_cpu(*batch.args(), out=poisoned_out(batch.query))
    assert out.dtype == torch.bfloat16
    # Both round the same float32 result to bf16; they differ only in summation order.
    expected = paged_attention_ref(*batch.args())
    torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out.double(), dense_attention(batch), rtol=2e-2, atol=2e-2)


@needs_c_kernel
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block_size", [16, 8])
def test_float32_queries_over_bfloat16_caches_match_the_reference(shape, block_size, cpu_isa):
    # --kv-cache-dtype bfloat16 under a float32 model: the kernel widens each K/V value to
    # float32, as the reference does with the rows it gathers. Decodes, short queries (one
    # decode per query token), and a batch with prompt chunks (the reference's SDPA).
    for query_lens in ([1] * 6, [3, 1, 2, 1, 4, 1], [1, 40, 1, 20, 1, 1]):
        batch = make_batch(query_lens, [0, 15, 16, 17, 40, 300], *shape, block_size=block_size, seed=4)
        batch.key_cache, batch.value_cache = batch.key_cache.bfloat16(), batch.value_cache.bfloat16()
        out = paged_attention_cpu(*batch.args(), out=poisoned_out(batch.query))
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, paged_attention_ref(*batch.args()), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.double(), dense_attention(batch), rtol=1e-5, atol=1e-5)


@needs_c_kernel
def test_kernel_takes_strided_query_and_output_rows(cpu_isa):
    # q as a slice of a fused qkv-like row, out as a slice of a wider buffer.
    batch = decode_batch([5, 20, 33], (6, 2, 64), torch.float32, seed=3)
    wide = torch.randn(3, 10, 64)
    wide[:, :6] = batch.query
    batch.query = wide[:, :6]
    out_buffer = torch.full((3, 8, 64), float("nan"))
    out = out_buffer[:, 1:7]
    assert decode_attention_native(batch.query, batch.key_cache, batch.value_cache, batch.attn.block_tables,
                                   batch.attn.seq_lens, batch.scale, out)  # fmt: skip
    torch.testing.assert_close(out.double(), dense_attention(batch), rtol=1e-5, atol=1e-5)
    assert out_buffer[:, 0].isnan().all() and out_buffer[:, 7].isnan().all()


@needs_c_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_a_lone_long_request_split_between_threads_gets_the_bits_of_one_thread_and_of_a_batch(shape, dtype, cpu_isa):
    """From 256 tokens of context, fewer requests than threads split their KV heads between
    the threads: each request's result is the one a single thread gives it, and the one it
    gets in a batch with others, bit for bit (batch invariance holds); short ones stay whole."""
    batch = decode_batch([700, 40, 300], shape, dtype, seed=5)
    args = (batch.key_cache, batch.value_cache)

    def attend(rows: slice, threads: int) -> torch.Tensor:
        out = poisoned_out(batch.query[rows])
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            assert decode_attention_native(batch.query[rows], *args, batch.attn.block_tables[rows],
                                           batch.attn.seq_lens[rows], batch.scale, out)
        finally:
            torch.set_num_threads(before)
        return out

    in_a_batch = attend(slice(0, 3), 1)
    torch.testing.assert_close(in_a_batch.double(), dense_attention(batch), rtol=2e-2, atol=2e-2)
    for i in range(3):
        for threads in (1, 2, 3):
            assert torch.equal(attend(slice(i, i + 1), threads), in_a_batch[i:i + 1]), (i, threads)
    for threads in (2, 4):  # two requests, more threads than requests
        assert torch.equal(attend(slice(0, 2), threads), in_a_batch[:2])


@needs_c_kernel
def test_block_table_rows_past_the_used_blocks_are_not_read():
    # make_batch fills table entries past each request's blocks with garbage, some out of
    # range: reading one would crash or change the result.
    batch = decode_batch([1, 16, 47], (4, 2, 64), torch.float32, block_size=16, seed=4)
    tables = batch.attn.block_tables
    assert (tables >= batch.key_cache.shape[0]).any() or (tables < 0).any()
    out = paged_attention_cpu(*batch.args())
    torch.testing.assert_close(out.double(), dense_attention(batch), rtol=1e-5, atol=1e-5)


@needs_c_kernel
def test_mixed_batches_and_other_dtypes_take_the_reference(monkeypatch):
    calls = []
    real = torch_attention.decode_attention_native

    def spy(*args):
        calls.append(args[0].dtype)
        return real(*args)

    monkeypatch.setattr(torch_attention, "decode_attention_native", spy)
    query_lens, context_lens = mixed_lens(seed=0)
    mixed = make_batch(query_lens, context_lens, 6, 2, 64, seed=5)
    out = paged_attention_cpu(*mixed.args(), out=poisoned_out(mixed.query))
    torch.testing.assert_close(out.double(), dense_attention(mixed), rtol=1e-5, atol=1e-5)
    assert calls == []  # a batch with prompt chunks never reaches the kernel
    half = decode_batch([4, 9], (4, 2, 64), torch.float16, seed=6)
    out = paged_attention_cpu(*half.args(), out=poisoned_out(half.query))
    torch.testing.assert_close(out.double(), dense_attention(half), rtol=1e-2, atol=1e-2)
    assert calls == [torch.float16]  # asked, declined (no float16 kernel), the reference ran


def test_without_the_kernel_the_reference_runs(monkeypatch):
    monkeypatch.setattr(torch_attention, "_kernel", lambda dtype, cache_dtype: None)
    batch = decode_batch([2, 30], (9, 3, 64), torch.float32, seed=7)
    out = paged_attention_cpu(*batch.args(), out=poisoned_out(batch.query))
    torch.testing.assert_close(out.double(), dense_attention(batch), rtol=1e-5, atol=1e-5)


@needs_c_kernel
@pytest.mark.parametrize("shape", SHAPES)
def test_short_queries_run_through_the_c_kernel_one_decode_per_token(shape, monkeypatch, cpu_isa):
    """A decode with its draft tokens (speculative decoding) next to plain decodes."""
    calls = []
    real = torch_attention.decode_attention_native

    def spy(*args):
        calls.append(args[3].shape[0])
        return real(*args)

    monkeypatch.setattr(torch_attention, "decode_attention_native", spy)
    batch = make_batch([1, 5, 3, 1, 17], [0, 15, 29, 40, 300], *shape, seed=8)
    out = paged_attention_cpu(*batch.args(), out=poisoned_out(batch.query))
    torch.testing.assert_close(out.double(), dense_attention(batch), rtol=1e-5, atol=1e-5)
    assert calls == [27]  # one decode per query token
    block_tables, seq_lens = batch.attn.token_decodes
    assert seq_lens.tolist()[:7] == [1, 16, 17, 18, 19, 20, 30]


# ------------------------------------------------------------------ sliding windows

# Windows shorter than a block, one block exactly, spanning blocks, and wider than every
# context (no effect); the blocks wholly before each window hold garbage ids.
WINDOWS = [5, 16, 23, 1000]


@pytest.mark.parametrize("window", WINDOWS)
def test_reference_with_a_sliding_window_matches_dense_attention(window):
    query_lens, context_lens = mixed_lens(seed=window)
    batch = make_batch(query_lens, context_lens, 6, 2, 64, block_size=8, seed=11, window=window)
    out = paged_attention_ref(*batch.args(), out=poisoned_out(batch.query))
    torch.testing.assert_close(out.double(), dense_attention(batch), rtol=1e-5, atol=1e-5)
    decodes = make_batch([1] * 5, [0, 15, 16, 17, 90], 6, 2, 64, block_size=8, seed=12, window=window)
    out = paged_attention_ref(*decodes.args(), out=poisoned_out(decodes.query))
    torch.testing.assert_close(out.double(), dense_attention(decodes), rtol=1e-5, atol=1e-5)


def test_a_window_changes_the_result():
    # Guards the test above: the window really hides keys there.
    batch = make_batch([1, 9], [40, 30], 6, 2, 64, block_size=8, seed=13, window=16)
    full = make_batch([1, 9], [40, 30], 6, 2, 64, block_size=8, seed=13)
    assert not torch.allclose(dense_attention(batch), dense_attention(full), atol=1e-3)


@needs_c_kernel
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("shape", SHAPES)
def test_c_kernel_with_a_sliding_window_matches_dense_attention(window, shape, cpu_isa):
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        batch = make_batch([1] * 6, [0, 15, 16, 17, 40, 300], *shape, block_size=8, dtype=dtype, seed=14,
                           window=window)
        out = paged_attention_cpu(*batch.args(), out=poisoned_out(batch.query))
        torch.testing.assert_close(out.double(), dense_attention(batch), rtol=tol, atol=tol)
    # Short queries: one decode per query token, each with its own window.
    batch = make_batch([1, 5, 3, 1, 17], [0, 15, 29, 40, 300], *shape, block_size=8, seed=15, window=window)
    out = paged_attention_cpu(*batch.args(), out=poisoned_out(batch.query))
    torch.testing.assert_close(out.double(), dense_attention(batch), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ batch invariance


def _chunk_of(batch, request: int, start: int, stop: int) -> torch.Tensor:
    """Query tokens start..stop of one request of ``batch`` attended as a step of their own
    (its context: the tokens before ``stop``), through the batch-invariant attention."""
    from kernels.attention_metadata import AttentionMetadata

    first = int(batch.attn.query_start_loc[request])
    context_before = int(batch.attn.seq_lens[request]) - (int(batch.attn.query_start_loc[request + 1]) - first)
    attn = AttentionMetadata(
        slot_mapping=batch.attn.slot_mapping[first + start:first + stop],
        block_tables=batch.attn.block_tables[request:request + 1],
        query_start_loc=torch.tensor([0, stop - start], dtype=torch.int32),
        seq_lens=torch.tensor([context_before + stop], dtype=torch.int32),
        max_query_len=stop - start, max_seq_len=context_before + stop,
    )
    query = batch.query[first + start:first + stop]
    return paged_attention_cpu_batch_invariant(query, batch.key_cache, batch.value_cache, attn, batch.scale,
                                               out=poisoned_out(query))


@needs_c_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(9, 3, 64), (16, 2, 128)])
def test_batch_invariant_attention_gives_each_token_the_same_bits_in_any_step(dtype, shape, cpu_isa):
    """Prompt chunks and decodes in one step; then each request's tokens alone, in chunks of
    other sizes, and decode by decode: every token's output is bit for bit the same."""
    batch = make_batch([1, 40, 7, 1, 100], [30, 0, 50, 3, 20], *shape, dtype=dtype, seed=9)
    together = paged_attention_cpu_batch_invariant(*batch.args(), out=poisoned_out(batch.query))
    torch.testing.assert_close(together.double(), dense_attention(batch), rtol=2e-2, atol=2e-2)
    starts = batch.attn.query_start_loc.tolist()
    for request in range(5):
        n = starts[request + 1] - starts[request]
        for chunk in (n, 16, 3, 1):
            pieces = [_chunk_of(batch, request, at, min(at + chunk, n)) for at in range(0, n, chunk)]
            assert torch.equal(torch.cat(pieces), together[starts[request]:starts[request + 1]]), (request, chunk)


def _one_decode_per_token(batch) -> torch.Tensor:
    """Every query token of ``batch`` attended alone by the C decode kernel (as a decode at
    its position): what a prompt token must equal bit for bit."""
    tables, lens = torch_attention._build_token_decodes(batch.attn)
    out = poisoned_out(batch.query)
    assert decode_attention_native(batch.query, batch.key_cache, batch.value_cache, tables, lens, batch.scale, out,
                                   batch.attn.sliding_window)
    return out


def multi_row_kernel_built(cpu_isa: str) -> bool:
    return "avx512_bf16" in cpu_flags() and cpu_isa == "native" and torch_attention._rows_kernel() is not None


@needs_c_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(9, 3, 64), (16, 2, 128), (8, 1, 64), (4, 4, 64), (6, 2, 96)])
@pytest.mark.parametrize("window,block_size", [(None, 16), (None, 8), (None, 32), (None, 5), (7, 16), (40, 8)])
def test_prompt_tokens_get_the_bits_of_their_own_decodes(dtype, shape, window, block_size, cpu_isa, monkeypatch):
    """The batch-invariant attention of a step with prompt chunks (first chunks, later
    chunks, chunks after a cached prefix, lengths off the kernels' tiles and pairs) and
    decodes: every token bit for bit what the C decode kernel gives it alone; bfloat16 takes
    the multi-row kernel where this build has AVX512_BF16 (and an even block size), the
    rest one decode per token. Against dense attention too."""
    ran = []
    real = torch_attention.decode_attention_rows_native
    monkeypatch.setattr(torch_attention, "decode_attention_rows_native", lambda *a: ran.append(real(*a)) or ran[-1])
    batch = make_batch([1, 61, 7, 1, 100, 33, 2], [30, 0, 50, 3, 20, 17, 300], *shape, block_size=block_size,
                       dtype=dtype, seed=21, window=window)
    out = paged_attention_cpu_batch_invariant(*batch.args(), out=poisoned_out(batch.query))
    assert torch.equal(out, _one_decode_per_token(batch))
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), dense_attention(batch), rtol=tol, atol=tol)
    takes = multi_row_kernel_built(cpu_isa) and dtype == torch.bfloat16 and block_size % 2 == 0
    assert ran == [takes]


def test_batch_invariant_attention_without_the_kernel_runs_the_reference(monkeypatch):
    monkeypatch.setattr(torch_attention, "_kernel", lambda dtype, cache_dtype: None)
    query_lens, context_lens = mixed_lens(seed=1)
    batch = make_batch(query_lens, context_lens, 6, 2, 64, seed=10)
    out = paged_attention_cpu_batch_invariant(*batch.args(), out=poisoned_out(batch.query))
    torch.testing.assert_close(out.double(), dense_attention(batch), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ long prompt chunks


def long_chunk_batch(shape, dtype):
    """Chunks of LONG_QUERY_MIN tokens or more (the first chunk of a prompt, a later chunk,
    one after a cached prefix, lengths not multiples of the kernels' blocks) beside a decode
    and a short chunk."""
    n = torch_attention.LONG_QUERY_MIN
    num_heads, num_kv_heads, head_dim = shape
    return make_batch([n, n + 37, 1, 40, 2 * n + 5], [0, 301, 90, 17, n], num_heads, num_kv_heads, head_dim,
                      dtype=dtype, seed=4)


LONG_SHAPES = [(9, 3, 64), (16, 2, 128), (8, 1, 64)]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@functools.cache
def long_chunk_case(shape, dtype):
    """The batch and its dense attention (computed once: float64 attention over 500-token
    chunks is the slow part of these tests)."""
    batch = long_chunk_batch(shape, dtype)
    return batch, dense_attention(batch)


def fresh_long_chunk_case(shape, dtype):
    """``long_chunk_case`` with metadata of its own (no plan left by another test)."""
    batch, want = long_chunk_case(shape, dtype)
    return dataclasses.replace(batch, attn=dataclasses.replace(batch.attn, prefill_plan=None)), want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", LONG_SHAPES)
def test_long_chunks_attend_causally_with_and_without_a_prefix(shape, dtype, monkeypatch):
    """Without the C prefill kernel, long chunks go request by request through PyTorch's
    flash attention in two parts merged, the others through the other paths; all against
    dense attention."""
    monkeypatch.setattr(torch_attention, "prefill_kernel_takes", lambda *args: False)
    batch, want = fresh_long_chunk_case(shape, dtype)
    out = paged_attention_cpu(*batch.args(), out=poisoned_out(batch.query))
    torch.testing.assert_close(out.double(), want, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    assert batch.attn.prefill_plan.native is None and len(batch.attn.prefill_plan.long) == 3


def prefill_kernel_built(cpu_isa: str) -> bool:
    return "avx512_bf16" in cpu_flags() and cpu_isa == "native" and torch_attention._prefill_kernel() is not None


@pytest.mark.parametrize("shape", LONG_SHAPES)
def test_the_prefill_kernel_takes_every_chunk_of_a_bfloat16_step(shape, cpu_isa):
    """The C kernel, where this build has AVX512_BF16, takes every request with more than
    SHORT_QUERY_MAX query tokens in one call (the decode and the 17-token chunk stay with the
    other paths); against dense attention."""
    if not prefill_kernel_built(cpu_isa):
        pytest.skip("the C prefill kernel needs AVX512_BF16 and a native build")
    batch, want = fresh_long_chunk_case(shape, torch.bfloat16)
    out = paged_attention_cpu(*batch.args(), out=poisoned_out(batch.query))
    torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=2e-2)
    plan = batch.attn.prefill_plan
    assert plan.native is not None and plan.taken.tolist() == [True, True, False, True, True]


def test_the_prefill_kernel_takes_many_short_chunks_at_once(cpu_isa):
    """A step of many short prompts (some after a cached prefix), as at high concurrency."""
    if not prefill_kernel_built(cpu_isa):
        pytest.skip("the C prefill kernel needs AVX512_BF16 and a native build")
    gen = torch.Generator().manual_seed(9)
    query_lens = torch.randint(18, 140, (24,), generator=gen).tolist()
    context_lens = [int(c) * 16 for c in torch.randint(0, 4, (24,), generator=gen)]
    batch = make_batch(query_lens, context_lens, 9, 3, 64, dtype=torch.bfloat16, seed=5)
    out = paged_attention_cpu(*batch.args(), out=poisoned_out(batch.query))
    torch.testing.assert_close(out.double(), dense_attention(batch), rtol=2e-2, atol=2e-2)
    assert batch.attn.prefill_plan.all_taken


def test_the_prefill_kernel_gives_a_token_the_same_bits_however_its_prompt_is_chunked_or_batched(cpu_isa):
    """A token's result depends on its query and its context's K/V only: the same 300-token
    prompt as one chunk, as its second half after the first, and beside other requests."""
    if not prefill_kernel_built(cpu_isa):
        pytest.skip("the C prefill kernel needs AVX512_BF16 and a native build")
    whole = make_batch([300], [0], 9, 3, 64, dtype=torch.bfloat16, seed=6)
    out_whole = paged_attention_cpu(*whole.args(), out=poisoned_out(whole.query))
    # The second half alone, over the same cache: its rows of the query, the prompt's first
    # 150 positions as context.
    half = dataclasses.replace(whole, query=whole.query[150:].clone(), attn=dataclasses.replace(
        whole.attn, query_start_loc=torch.tensor([0, 150], dtype=torch.int32), max_query_len=150,
        prefill_plan=None))
    out_half = paged_attention_cpu(*half.args(), out=poisoned_out(half.query))
    assert torch.equal(out_half, out_whole[150:])
    # Beside other requests (their caches elsewhere): the same rows, bit for bit.
    others = make_batch([40, 300, 77], [10, 0, 200], 9, 3, 64, dtype=torch.bfloat16, seed=7)
    start = int(others.attn.query_start_loc[1])
    others.query[start : start + 300] = whole.query
    table = others.attn.block_tables[1]
    for i in range(-(-300 // 16)):
        others.key_cache[table[i]] = whole.key_cache[whole.attn.block_tables[0, i]]
        others.value_cache[table[i]] = whole.value_cache[whole.attn.block_tables[0, i]]
    out_others = paged_attention_cpu(*others.args(), out=poisoned_out(others.query))
    assert torch.equal(out_others[start : start + 300], out_whole)
