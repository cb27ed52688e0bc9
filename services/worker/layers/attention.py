"""One layer's attention over the paged KV cache: rotary, KV write, paged attention.

The layer belongs to one KV cache group (``kv_group``): the layers of one attention kind
(full, or one sliding window) share a block table, and the step's ``AttentionMetadata`` of
that group (its slot mapping, block tables and sliding window) is what the layer reads.
See ``services/worker/kv_cache.py`` for the groups.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import AttentionMetadata, KernelOps

from .rotary import RotaryEmbedding


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, rotary: RotaryEmbedding,
                 ops: KernelOps, kv_group: int = 0, sliding_window: int | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale, self.rotary, self.ops = scale, rotary, ops
        self.kv_group = kv_group
        self.sliding_window = sliding_window  # the group's metadata carries it to the kernels

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                attn: AttentionMetadata, kv_cache) -> torch.Tensor:
        """q ``[T, heads * head_dim]``, k and v ``[T, kv heads * head_dim]`` (strided rows
        allowed) -> ``[T, heads * head_dim]``; q and k are rotated in place."""
        num_tokens = q.shape[0]
        k_cache, v_cache = kv_cache
        self.ops.rotary_write_kv(positions, q, k, v, self.rotary.cos_sin_cache, self.head_dim, k_cache, v_cache,
                                 attn.slot_mapping)
        out = self.ops.paged_attention(q.view(num_tokens, self.num_heads, self.head_dim), k_cache, v_cache, attn,
                                       self.scale)
        return out.view(num_tokens, self.num_heads * self.head_dim)
