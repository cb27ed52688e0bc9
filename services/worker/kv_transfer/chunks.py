"""How a request's KV blocks are split into chunks, each under the bus's payload limit.

Whole blocks with every layer when a block fits (several blocks per chunk); otherwise
one block per chunk, in runs of layers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Chunk:
    first_block: int  # index into the request's blocks being moved
    num_blocks: int
    first_layer: int
    num_layers: int


def plan_chunks(num_blocks: int, num_layers: int, layer_block_bytes: int, max_bytes: int) -> list[Chunk]:
    per_block = num_layers * layer_block_bytes
    blocks_per_chunk = max_bytes // per_block
    if blocks_per_chunk >= 1:
        return [Chunk(b, min(blocks_per_chunk, num_blocks - b), 0, num_layers)
                for b in range(0, num_blocks, blocks_per_chunk)]
    layers_per_chunk = max(1, max_bytes // layer_block_bytes)
    return [Chunk(b, 1, layer, min(layers_per_chunk, num_layers - layer))
            for b in range(num_blocks) for layer in range(0, num_layers, layers_per_chunk)]
