"""The scheduler's view of the disk tier: whether every worker rank files a unit under a
block's hash, and how many blocks that unit holds.

The folder is shared by the host's engines and outlives them, so no index the scheduler
could keep would be true for long: it asks the file system (one ``stat`` per rank and name,
microseconds; the file's size tells its block count, ``shared/kv_unit_file.py``). Files
appear whole (atomic rename) or not at all; a file that turns out corrupt when read fails
its load, and the request recomputes. ``folders`` names the ranks' folders as the file
system knows them, so a scheduler can tell that somebody deleted them (or their root).
"""

from __future__ import annotations

import os

from shared.kv_unit_file import num_blocks_of, unit_path


class DiskProbe:
    def __init__(self, root: str, namespaces: list[str], block_bytes: list[int]) -> None:
        """``namespaces`` and ``block_bytes``: each rank's folder name and bytes of one block
        of its shard, by rank (from their WorkerReady)."""
        self.root = root
        self.ranks = list(zip(namespaces, block_bytes))

    def blocks(self, name: bytes) -> int:
        """The block count of the unit filed under ``name`` by every rank (0: none)."""
        counts = set()
        for namespace, block_bytes in self.ranks:
            try:
                size = os.stat(unit_path(self.root, namespace, name)).st_size
            except OSError:
                return 0
            counts.add(num_blocks_of(size, block_bytes))
        return counts.pop() if len(counts) == 1 else 0

    def folders(self) -> tuple:
        """Each rank's folder as (device, inode), None where it is missing: another tuple
        later means other folders (one deleted and made again gets another inode, unless the
        file system hands the same number out again)."""
        out = []
        for namespace, _ in self.ranks:
            try:
                stat = os.stat(os.path.join(self.root, namespace))
                out.append((stat.st_dev, stat.st_ino))
            except OSError:
                out.append(None)
        return tuple(out)
