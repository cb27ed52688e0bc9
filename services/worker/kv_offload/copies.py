"""Copies of whole KV blocks between the paged cache and unit buffers.

A unit buffer holds ``n`` blocks of every layer as ``[2 * layers, n, block_size, KV heads,
head_dim]``: per layer the keys of the blocks, then their values (``KVBlockIO``'s chunk
layout, so a P/D chunk, a host slot and a unit file hold the same bytes). Each copy moves
a whole unit: one gather or scatter per layer and K/V, of all its blocks at once.

On the CPU the caches and buffers are numpy views (``KVBlockIO.arrays``): numpy copies use
no OpenMP threads, so a copy on the offloading thread does not start a second OpenMP pool
beside the forward pass's. On a GPU the host buffers are pinned and every copy runs on a
side stream: a store gathers the blocks on the device and sends them to the host in one
transfer, and the forward pass's stream waits for it (``fence``) only before it may write
into those blocks; a load's copies end before the load is reported done.
"""

from __future__ import annotations

import mmap
import threading

import numpy as np
import torch

from services.worker.kv_transfer.block_io import KVBlockIO

_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux: fault every page in at mmap time


class CpuUnitCopier:
    def __init__(self, io: KVBlockIO) -> None:
        self.io = io
        self.num_layers = io.num_layers
        self.block_shape = io.block_shape
        self.dtype = io.arrays[0][0].dtype
        self.block_bytes = io.chunk_bytes(1, io.num_layers)

    def unit_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (2 * self.num_layers, num_blocks, *self.block_shape)

    def allocate_slots(self, num_slots: int, unit_blocks: int) -> np.ndarray:
        """Host slots ``[slots, 2 * layers, unit_blocks, ...]``, their pages taken now.

        Taken at start-up, not by the stores: a first write to a page faults, and numpy
        advises huge pages for large arrays, whose faults cost ~7x more CPU here (1 GiB:
        2.4 s with the advice, 0.33 s populated at once), all of it on the forward thread."""
        shape = (num_slots, *self.unit_shape(unit_blocks))
        nbytes = int(np.prod(shape)) * self.dtype.itemsize
        memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_POPULATE)
        return np.frombuffer(memory, dtype=self.dtype).reshape(shape)

    def empty(self, num_blocks: int) -> np.ndarray:
        return np.empty(self.unit_shape(num_blocks), dtype=self.dtype)

    def gather(self, block_ids: list[int], out: np.ndarray) -> None:
        """Device blocks ``block_ids`` into ``out`` (``[2 * layers, len(block_ids), ...]``)."""
        ids = np.asarray(block_ids, dtype=np.int64)
        for layer, (k, v) in enumerate(self.io.arrays):
            np.take(k, ids, axis=0, out=out[2 * layer], mode="clip")  # ids are in range; "raise" would buffer
            np.take(v, ids, axis=0, out=out[2 * layer + 1], mode="clip")

    def scatter(self, block_ids: list[int], parts: np.ndarray) -> None:
        """``parts`` (``[2 * layers, len(block_ids), ...]``) into device blocks ``block_ids``."""
        ids = np.asarray(block_ids, dtype=np.int64)
        for layer, (k, v) in enumerate(self.io.arrays):
            k[ids] = parts[2 * layer]
            v[ids] = parts[2 * layer + 1]

    def to_bytes(self, unit) -> memoryview:
        """The raw bytes of a unit buffer (a view; copy it if the buffer will change)."""
        return memoryview(np.ascontiguousarray(unit)).cast("B")

    def from_bytes(self, data, num_blocks: int) -> np.ndarray:
        return np.frombuffer(data, dtype=self.dtype).reshape(self.unit_shape(num_blocks))

    def host_view(self, slots, slot: int, num_blocks: int, offset: int = 0):
        return slots[slot, :, offset:offset + num_blocks]

    def fence(self) -> None:
        """Make the forward pass wait for the stores issued so far (nothing to do on the CPU:
        the stores are done when they return)."""

    def synchronize(self) -> None:
        """Wait until every copy issued so far is done."""


class CudaUnitCopier(CpuUnitCopier):
    def __init__(self, io: KVBlockIO) -> None:
        self.io = io
        self.num_layers = io.num_layers
        self.block_shape = io.block_shape
        self.device = io.caches[0][0].device
        self.dtype = io.caches[0][0].dtype
        self.block_bytes = io.chunk_bytes(1, io.num_layers)
        self.stream = torch.cuda.Stream(device=self.device)
        self._stored = torch.cuda.Event()
        self._lock = threading.Lock()  # the offloading and disk threads both issue copies

    def allocate_slots(self, num_slots: int, unit_blocks: int) -> torch.Tensor:
        return torch.empty((num_slots, *self.unit_shape(unit_blocks)), dtype=self.dtype, pin_memory=True)

    def empty(self, num_blocks: int) -> torch.Tensor:
        return torch.empty(self.unit_shape(num_blocks), dtype=self.dtype, pin_memory=True)

    def _device_ids(self, block_ids: list[int]) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.int64).to(self.device, non_blocking=True)

    def gather(self, block_ids: list[int], out: torch.Tensor) -> None:
        with self._lock, torch.cuda.stream(self.stream):
            # The blocks were written by forward passes on the default stream.
            self.stream.wait_stream(torch.cuda.default_stream(self.device))
            ids = self._device_ids(block_ids)
            staged = torch.stack([t.index_select(0, ids) for pair in self.io.caches for t in pair])
            out.copy_(staged, non_blocking=True)
            self._stored.record(self.stream)

    def scatter(self, block_ids: list[int], parts) -> None:
        if isinstance(parts, np.ndarray):
            parts = torch.from_numpy(parts)
        with self._lock, torch.cuda.stream(self.stream):
            ids = self._device_ids(block_ids)
            staged = parts.to(self.device, non_blocking=True)
            for layer, (k, v) in enumerate(self.io.caches):
                k.index_copy_(0, ids, staged[2 * layer])
                v.index_copy_(0, ids, staged[2 * layer + 1])
            done = torch.cuda.Event()
            done.record(self.stream)
        done.synchronize()  # the load is reported done only once its blocks hold the data

    def to_bytes(self, unit) -> memoryview:
        self.synchronize()  # a slot still being filled by a store
        return memoryview(unit.contiguous().view(torch.uint8).numpy()).cast("B")

    def from_bytes(self, data, num_blocks: int) -> torch.Tensor:
        return torch.frombuffer(data, dtype=torch.uint8).view(self.dtype).reshape(self.unit_shape(num_blocks))

    def fence(self) -> None:
        torch.cuda.default_stream(self.device).wait_event(self._stored)

    def synchronize(self) -> None:
        self.stream.synchronize()


def unit_copier(io: KVBlockIO) -> CpuUnitCopier:
    return CpuUnitCopier(io) if io.on_cpu else CudaUnitCopier(io)
