"""Bind a worker to its cores before torch loads OpenMP (``--cpu-omp-threads-bind``).

A worker runs its CPU ops on PyTorch's OpenMP pool, one thread per core it may use. Two
workers on one machine (data-parallel engines, TP ranks) that each take every core fight
over them: each pool's threads wait for time slices the other's hold. Bound, a worker may
use only its cores (``sched_setaffinity``) and its pool has one thread per such core
(``OMP_NUM_THREADS``, unless already set). ``scripts/serve`` gives each worker its share
(``shared/cpu_sets.py``'s ``split_cores``); compose's workers take the variable.
"""

from __future__ import annotations

import logging
import os
import sys

from shared.cpu_sets import cores_for_rank, format_cpu_list

logger = logging.getLogger(__name__)


def apply_cpu_binding(bind: str, rank: int, environ=os.environ) -> list[int] | None:
    """Bind this process to its cores and size OpenMP's pool to them; the cores (None:
    unbound)."""
    cpus = cores_for_rank(bind, rank)
    if cpus is None:
        return None
    if "torch" in sys.modules:
        logger.warning("cpu binding %r set after torch was imported: the thread count may not apply", bind)
    os.sched_setaffinity(0, cpus)
    environ.setdefault("OMP_NUM_THREADS", str(len(cpus)))
    logger.info("worker rank %d bound to cores %s (%s OpenMP threads)", rank, format_cpu_list(cpus),
                environ["OMP_NUM_THREADS"])
    return cpus
