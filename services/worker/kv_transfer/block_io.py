"""Whole KV blocks of the paged cache as bytes, for P/D transfers.

A chunk is blocks ``block_ids`` of layers ``first_layer .. first_layer + num_layers``: per
layer, the keys of every block, then their values, each ``[blocks, block_size, KV heads,
head_dim]`` in the cache's dtype. On the CPU the caches are read and written through numpy
views of the same memory (numpy copies use no OpenMP threads: a second OpenMP pool in this
process would slow the forward thread's every op); on a GPU through torch.
"""

from __future__ import annotations

import numpy as np
import torch

# Same-sized integer types: numpy views of caches in any dtype (bfloat16 included).
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class KVBlockIO:
    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.caches = kv_caches
        self.num_layers = len(kv_caches)
        first = kv_caches[0][0]
        self.on_cpu = first.device.type == "cpu"
        self.block_shape = tuple(first.shape[1:])
        self.element_size = first.element_size()
        if self.on_cpu:
            as_int = _INT_OF_SIZE[self.element_size]
            self.arrays = [(k.view(as_int).numpy(), v.view(as_int).numpy()) for k, v in kv_caches]

    @property
    def layer_block_bytes(self) -> int:
        """Keys and values of one block in one layer."""
        return 2 * int(np.prod(self.block_shape)) * self.element_size

    def chunk_bytes(self, num_blocks: int, num_layers: int) -> int:
        return num_blocks * num_layers * self.layer_block_bytes

    def gather(self, block_ids: list[int], first_layer: int, num_layers: int) -> bytes:
        layers = range(first_layer, first_layer + num_layers)
        if self.on_cpu:
            ids = np.asarray(block_ids, dtype=np.int64)
            first_array = self.arrays[0][0]
            out = np.empty((2 * num_layers, len(ids), *self.block_shape), dtype=first_array.dtype)
            for i, layer in enumerate(layers):
                for j, array in enumerate(self.arrays[layer]):
                    np.take(array, ids, axis=0, out=out[2 * i + j])
            return out.tobytes()
        ids = torch.tensor(block_ids, device=self.caches[0][0].device)
        parts = [tensor.index_select(0, ids) for layer in layers for tensor in self.caches[layer]]
        return torch.stack(parts).cpu().view(torch.uint8).numpy().tobytes()

    def scatter(self, block_ids: list[int], first_layer: int, num_layers: int, data: bytes) -> None:
        layers = range(first_layer, first_layer + num_layers)
        shape = (2 * num_layers, len(block_ids), *self.block_shape)
        if self.on_cpu:
            ids = np.asarray(block_ids, dtype=np.int64)
            parts = np.frombuffer(data, dtype=self.arrays[0][0].dtype).reshape(shape)
            for i, layer in enumerate(layers):
                for j, array in enumerate(self.arrays[layer]):
                    array[ids] = parts[2 * i + j]
            return
        device = self.caches[0][0].device
        dtype = self.caches[0][0].dtype
        parts = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape).to(device)
        ids = torch.tensor(block_ids, device=device)
        for i, layer in enumerate(layers):
            for j, tensor in enumerate(self.caches[layer]):
                tensor.index_copy_(0, ids, parts[2 * i + j])
