"""The scheduler's view of the disk tier: whether every worker rank's file of a unit exists.

The folder is shared by the host's engines and outlives them, so no index the scheduler
could keep would be true for long: it asks the file system (one ``stat`` per rank and
unit, microseconds). Files appear whole (atomic rename) or not at all; a file that turns
out corrupt when read fails its load, and the request recomputes.
"""

from __future__ import annotations

import os

from shared.kv_offload_layout import unit_path


class DiskProbe:
    def __init__(self, root: str, namespaces: list[str]) -> None:
        """``namespaces``: each rank's folder name, by rank (from their WorkerReady)."""
        self.root = root
        self.namespaces = namespaces

    def has(self, key: bytes) -> bool:
        return all(os.path.exists(unit_path(self.root, ns, key)) for ns in self.namespaces)
