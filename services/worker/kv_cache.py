"""The paged KV cache's tensors: (key, value) pairs of ``[blocks, block_size, KV heads,
head_dim]``, for the target model and for a draft model alike.

A block holds ``layout.group_size`` layers' KV (``shared.kv_cache_groups``): pair ``j``
serves the ``j``-th layer of every KV cache group, so a model whose layers all attend
alike has one pair per layer, and a hybrid one (Gemma 3's sliding and global layers)
fewer pairs than layers, each shared by one layer of each group."""

from __future__ import annotations

import torch

from shared.kv_cache_groups import KVCacheLayout


def kv_block_bytes(block_size: int, num_kv_heads: int, head_dim: int, num_layers: int, dtype: torch.dtype) -> int:
    """Bytes of one block over ``num_layers`` (key, value) pairs."""
    return 2 * block_size * num_kv_heads * head_dim * num_layers * torch.finfo(dtype).bits // 8


def allocate_kv_caches(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, num_layers: int, dtype: torch.dtype,
    device: torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``num_layers`` zeroed (key, value) pairs."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(num_layers)
    ]


def layer_kv_caches(pairs: list, layout: KVCacheLayout) -> list:
    """Each layer's (key, value) pair, in layer order."""
    num_layers = sum(len(group.layers) for group in layout.groups)
    return [pairs[layout.tensor_of(layer)] for layer in range(num_layers)]
