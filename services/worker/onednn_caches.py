"""Bound oneDNN's and ideep's per-shape caches before torch loads them.

On CPU every weight product goes through oneDNN (``services/worker/linear.py``), which
caches a primitive per product shape, and ideep above it caches its own per shape; both
hold 1,024 entries by default. A server sees a new row count with almost every new mix of
prompt chunks and decodes, so over hours both caches fill, and the worker's RSS grew by
hundreds of MiB before levelling off (docs/BENCHMARKS.md, the soak). Creating a missed
primitive costs ~0.3 ms, and a step reuses the few shapes of the batch it is in, so a
smaller bound keeps every hit that matters. A user's own setting of either variable wins.
"""

from __future__ import annotations

import os

CACHE_CAPACITY = 256  # entries in each of oneDNN's primitive cache and ideep's LRU cache

VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_onednn_caches(environ=os.environ) -> None:
    """Set the caches' capacity; must run before torch is imported (both read it once)."""
    for name in VARIABLES:
        environ.setdefault(name, str(CACHE_CAPACITY))
