"""Where the disk tier files a unit: the one path rule the scheduler (which looks units up)
and the workers (which write and read them) share.

``<--kv-offloading-path>/<namespace>/<first two hex digits of the key>/<key in hex>.kv``:
the namespace is one worker rank's (``services/worker/kv_offload/disk_tier.py``), the key
the hash of the unit's last block.
"""

from __future__ import annotations

import os

UNIT_SUFFIX = ".kv"


def unit_path(root: str, namespace: str, key: bytes) -> str:
    name = key.hex()
    return os.path.join(root, namespace, name[:2], name + UNIT_SUFFIX)
