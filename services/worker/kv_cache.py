"""The paged KV cache's tensors: one (key, value) pair of ``[blocks, block_size, KV heads,
head_dim]`` per layer, for the target model and for a draft model alike."""

from __future__ import annotations

import torch


def kv_block_bytes(block_size: int, num_kv_heads: int, head_dim: int, num_layers: int, dtype: torch.dtype) -> int:
    """Bytes of one block over every layer, keys and values."""
    return 2 * block_size * num_kv_heads * head_dim * num_layers * torch.finfo(dtype).bits // 8


def allocate_kv_caches(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, num_layers: int, dtype: torch.dtype,
    device: torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(num_layers)
    ]
