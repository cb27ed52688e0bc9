"""The worker's LoRA slots: which adapters are on the device, and the model's hook into them.

``--max-loras`` slots hold one adapter each, as rows of one A and one B tensor per layer
and fused projection (``batched.py``), this rank's part of it under tensor parallelism
(``sharding.py``). A step's requests name their adapters
(``LoRARequest``); ``set_step`` puts each into a slot (already resident, a free slot, or
the least recently used slot not needed by this step and not pinned; a request marked
``pinned`` pins its adapter), then gives every token its slot (``batched.LoRABatch``),
which the wrapped projections read. Adapters are read from
disk in a background thread (``prefetch``, called as soon as a request or a load message
names one) into a host cache of ``--max-cpu-loras`` adapters; a step only waits for a
read still under way (bounded by ``LOAD_TIMEOUT_S``).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from shared.config import LoRAConfig
from shared.lora_shapes import FUSED_PROJECTIONS, ProjectionShapes
from shared.model_config import ModelConfig
from shared.protocol import LoRARequest

from .adapter import LoRAAdapter, load_lora_adapter
from .batched import LoRABatch, add_lora
from .sharding import LoRAShard

logger = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 60.0

AdapterKey = tuple[str, str]  # (lora_name, lora_path): a name loaded again from elsewhere is new


def adapter_key(request: LoRARequest) -> AdapterKey:
    return request.lora_name, request.lora_path


class LoRASlots:
    def __init__(self, model, model_config: ModelConfig, config: LoRAConfig, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.config = config
        self.model_config = model_config
        self.device, self.dtype = device, dtype
        num_slots, max_rank = config.max_loras, config.max_lora_rank
        shapes = ProjectionShapes.of(model_config)
        # This rank's part of each adapter (all of it with one rank).
        self.shard = LoRAShard.of(model_config, getattr(model, "shard", None))
        self.a_slots: list[dict[str, torch.Tensor]] = []
        self.b_slots: list[dict[str, torch.Tensor]] = []
        for _ in range(model_config.num_hidden_layers):
            self.a_slots.append({p: torch.zeros(num_slots, shapes.stacked_rank(p, max_rank), self.shard.in_features[p],
                                                device=device, dtype=dtype) for p in FUSED_PROJECTIONS})
            self.b_slots.append({p: torch.zeros(num_slots, shapes.stacked_rank(p, max_rank),
                                                self.shard.out_features[p], device=device, dtype=dtype)
                                 for p in FUSED_PROJECTIONS})
        # The step's tokens and their slots (None: no token of the step has an adapter).
        self.batch: LoRABatch | None = None
        self.method: str | None = None  # force one of batched.METHODS (benchmarks, tests); None: chosen per step
        self.slot_keys: list[AdapterKey | None] = [None] * num_slots
        self.resident: OrderedDict[AdapterKey, int] = OrderedDict()  # least recently used first
        self.pinned: set[AdapterKey] = set()
        self.host_cache: OrderedDict[AdapterKey, LoRAAdapter] = OrderedDict()
        self._loading: dict[AdapterKey, Future] = {}
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-load")
        self._model = model
        self._originals: list[tuple[object, str, object]] = []
        self._wrap_projections(model)
        for lora in config.modules():  # --lora-modules: read them now, in the background
            self.prefetch(lora)

    # ------------------------------------------------------------------ the model's hook

    def _wrap_projections(self, model) -> None:
        """Wrap each target layer's local product (``proj``): a row-parallel layer's delta
        joins its partial sum before the all-reduce."""
        for targets, a_by_proj, b_by_proj in zip(model.lora_targets(), self.a_slots, self.b_slots):
            for projection, layer in targets.items():
                base = layer.proj
                self._originals.append((layer, "proj", base))
                layer.proj = self._with_lora(base, a_by_proj[projection], b_by_proj[projection],
                                             self.shard.out_splits[projection])

    def _with_lora(self, base, a_slots: torch.Tensor, b_slots: torch.Tensor, out_splits: tuple[int, ...]):
        def linear(x: torch.Tensor) -> torch.Tensor:
            y = base(x)
            if self.batch is None:
                return y
            return add_lora(y, x, a_slots, b_slots, self.batch, out_splits)

        return linear

    def detach(self) -> None:
        """Give the model back its plain projections."""
        for module, attr, base in self._originals:
            setattr(module, attr, base)
        self._originals.clear()
        self._loader.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ host cache

    def prefetch(self, request: LoRARequest) -> None:
        """Start reading the adapter from disk unless it is cached or being read."""
        key = adapter_key(request)
        if key in self.host_cache or key in self._loading:
            return
        self._loading[key] = self._loader.submit(
            load_lora_adapter, request.lora_name, request.lora_path, self.model_config, self.config.max_lora_rank
        )

    def _host_adapter(self, request: LoRARequest) -> LoRAAdapter:
        key = adapter_key(request)
        adapter = self.host_cache.get(key)
        if adapter is not None:
            self.host_cache.move_to_end(key)
            return adapter
        self.prefetch(request)
        future = self._loading[key]
        try:
            adapter = future.result(timeout=LOAD_TIMEOUT_S)
        finally:
            if future.done():
                self._loading.pop(key, None)
        self.host_cache[key] = adapter
        while len(self.host_cache) > self.config.host_capacity:
            self.host_cache.popitem(last=False)
        return adapter

    # ------------------------------------------------------------------ slots

    def pin(self, request: LoRARequest) -> None:
        """Keep the adapter in a slot from now on (never evicted). A request with
        ``pinned`` set pins its adapter when it first gets a slot: the scheduler counts
        the slot as taken from the step that sends it."""
        self.pinned.add(adapter_key(request))

    def unpin(self, lora_name: str) -> None:
        """The adapter was unloaded: its slot may be reused (requests still running under
        it keep it by LRU, as any adapter's)."""
        self.pinned = {k for k in self.pinned if k[0] != lora_name}

    def remove(self, lora_name: str) -> None:
        """Forget every adapter of that name (unloaded): its slot becomes free."""
        for key in [k for k in self.host_cache if k[0] == lora_name]:
            del self.host_cache[key]
        for key in [k for k in self.resident if k[0] == lora_name]:
            self.slot_keys[self.resident.pop(key)] = None
        self.pinned = {k for k in self.pinned if k[0] != lora_name}

    def _slot_for(self, request: LoRARequest, step_keys: set[AdapterKey]) -> int:
        key = adapter_key(request)
        slot = self.resident.get(key)
        if slot is not None:
            self.resident.move_to_end(key)
            return slot
        adapter = self._host_adapter(request)
        if None in self.slot_keys:
            slot = self.slot_keys.index(None)
        else:
            slot = self.resident.pop(self._victim(step_keys))
        self._write_slot(slot, adapter)
        self.slot_keys[slot] = key
        self.resident[key] = slot
        return slot

    def _victim(self, step_keys: set[AdapterKey]) -> AdapterKey:
        """The least recently used adapter this step does not need, pinned ones last."""
        unneeded = [k for k in self.resident if k not in step_keys]
        if not unneeded:
            raise RuntimeError(f"a step needs more LoRA adapters than the {len(self.slot_keys)} slots "
                               f"(max_loras) hold")
        unpinned = [k for k in unneeded if k not in self.pinned]
        if unpinned:
            return unpinned[0]
        # The scheduler counts pinned slots as taken, so this happens only when it did not
        # hear of them (it restarted, or an unload message was lost): serve the step anyway.
        logger.warning("LoRA adapter %r was pinned, but the step needs its slot: evicted", unneeded[0][0])
        self.pinned.discard(unneeded[0])
        return unneeded[0]

    def _write_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        for layer, a_by_proj, b_by_proj in zip(adapter.weights, self.a_slots, self.b_slots):
            for projection, a_slots in a_by_proj.items():
                b_slots = b_by_proj[projection]
                if projection in layer:
                    a, b = layer[projection]
                    a_slots[slot].copy_(self.shard.a(projection, a), non_blocking=True)
                    b_slots[slot].copy_(self.shard.b(projection, b).t(), non_blocking=True)
                else:
                    a_slots[slot].zero_()
                    b_slots[slot].zero_()

    def set_step(self, loras: list[LoRARequest | None], num_scheduled: np.ndarray) -> None:
        """Put this step's adapters into slots and give every token its slot row:
        ``loras[i]`` is request row i's adapter, ``num_scheduled[i]`` its tokens."""
        if not any(loras):
            self.batch = None
            return
        step_keys = {adapter_key(r) for r in loras if r is not None}
        rows = [i for i, r in enumerate(loras) if r is not None]
        slots = [self._slot_for(loras[i], step_keys) for i in rows]
        for i in rows:
            if loras[i].pinned:
                self.pin(loras[i])
        by_request = torch.full((len(loras),), -1, dtype=torch.int64)
        by_request[rows] = torch.tensor(slots, dtype=torch.int64)
        repeats = torch.from_numpy(np.asarray(num_scheduled, dtype=np.int64))
        token_slot = by_request.repeat_interleave(repeats)
        self.batch = LoRABatch.build(token_slot, len(self.slot_keys), self.dtype, self.device, self.method)
