"""What a step's attention reads besides the query and the KV cache, built once per step.

The model runner builds one `AttentionMetadata` for each step from the persistent batch
and every layer's `write_kv` and `paged_attention` call reads it. Request i owns query
tokens query_start_loc[i]:query_start_loc[i+1] and a context of seq_lens[i] tokens (its
new tokens included), read through block_tables[i]; token t's new K/V goes to cache slot
slot_mapping[t] (block * block_size + offset). With a sliding window W, query position p
attends to positions p - W + 1 .. p only; block table entries wholly before the window
may name blocks that are no longer the request's (the kernels never read them, or read
them masked).

What a backend derives from these once per step and shares between layers lives here
too, so it lives and dies with the step: the CPU attention's decode plan is built by
the first layer that needs it (see `kernels.paged_attention_torch`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DecodePlan:
    """What every layer's decode attention shares within one all-decode step (the "torch"
    backend builds it with its first layer)."""

    blocks: torch.Tensor  # [n * num_blocks] int64: each request's blocks, in order
    span: int  # num_blocks * block_size: keys read per request
    bias: torch.Tensor  # [n, 1, span] float32: 0 for visible keys, -inf past seq_len and before a sliding window
    query_rows: torch.Tensor | None  # [n] int64 rows of `query`; None: row i is request i


@dataclass
class PrefillPlan:
    """What every layer's attention of a step with prompt chunks shares (the "torch"
    backend builds it with its first layer): the requests the chunk path takes (`taken`
    [N] bool) and, for the C prefill kernel, its int32 arrays (`native`: block tables,
    query starts, query lengths, context lengths; None where it cannot run), or else per
    long request (block table, start, length, seq_len) for PyTorch's flash attention."""

    taken: torch.Tensor
    all_taken: bool
    native: tuple[torch.Tensor, ...] | None
    long: list[tuple[torch.Tensor, int, int, int]]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    max_query_len: int
    max_seq_len: int
    # Each query sees only the last sliding_window positions, itself included (None: all).
    sliding_window: int | None = None
    # An all-decode step's plan for the PyTorch decode attention; None until built.
    decode_plan: DecodePlan | None = None
    # A step of short queries (speculative decoding's drafts) as one decode per query
    # token: (block table row per token, context length per token); None until built.
    token_decodes: tuple[torch.Tensor, torch.Tensor] | None = None
    # A step with prompt chunks: which requests the CPU's chunk path attends, and its
    # arguments (`PrefillPlan`); None until built.
    prefill_plan: PrefillPlan | None = None
    # The step's requests as int32 arrays for the C kernels that take whole requests (block
    # tables, query starts, query lengths, context lengths); None until built.
    request_rows: tuple[torch.Tensor, ...] | None = None
