"""KV cache groups: the layers of each attention kind share one block table.

As vLLM's hybrid KV cache manager groups them. Layers of one kind (full attention, or a
sliding window of one size) form groups of ``group_size`` layers each; every group has its
own block table per request, drawn from the one block pool. A block id names the same
memory in every group: ``group_size`` (key, value) tensor pairs, pair ``j`` serving the
``j``-th layer of whichever group holds the block. So a block is one page of
``group_size`` layers' KV, and a sliding-window group can give back the blocks that fell
out of its window while the full-attention groups keep theirs (the scheduler's
``kv_cache_manager``). ``group_size`` is the smallest layer count of any kind (a kind's
last group may be shorter: its pairs past its layers are unused by it).

A model whose layers are all of one kind has one group of all its layers: one block table,
a block holding every layer's KV (as before groups existed). Full-attention groups come
first, so group 0 is a full-attention group whenever the model has one.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroup:
    sliding_window: int | None  # None: full attention
    layers: tuple[int, ...]


@dataclass(frozen=True)
class KVCacheLayout:
    groups: tuple[KVCacheGroup, ...]
    group_size: int  # layers per block: the (key, value) tensor pairs of the pool

    @property
    def sliding_windows(self) -> list[int]:
        """Each group's window, 0 for full attention (the form the protocol carries)."""
        return [g.sliding_window or 0 for g in self.groups]

    def group_of(self, layer: int) -> int:
        return next(i for i, g in enumerate(self.groups) if layer in g.layers)

    def tensor_of(self, layer: int) -> int:
        """Which (key, value) tensor pair layer ``layer`` reads and writes."""
        return self.groups[self.group_of(layer)].layers.index(layer)

    @property
    def is_hybrid(self) -> bool:
        """More than one group, or any sliding window: block tables differ from a single
        full-attention table (the features that assume one, such as P/D, refuse it)."""
        return len(self.groups) > 1 or self.groups[0].sliding_window is not None


def kv_cache_layout(layer_windows: list[int | None]) -> KVCacheLayout:
    """The groups for layers with these sliding windows (None: full attention)."""
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        kinds.setdefault(window, []).append(layer)
    group_size = min(len(layers) for layers in kinds.values())
    groups = []
    for window in sorted(kinds, key=lambda w: (w is not None, w or 0)):
        layers = kinds[window]
        groups += [KVCacheGroup(window, tuple(layers[i:i + group_size])) for i in range(0, len(layers), group_size)]
    return KVCacheLayout(tuple(groups), group_size)


def model_kv_cache_layout(config) -> KVCacheLayout:
    """The layout of a ``ModelConfig``'s layers."""
    return kv_cache_layout([config.layer_sliding_window(i) for i in range(config.num_hidden_layers)])
