"""Set the OpenMP wait policy of the worker's threads before torch loads OpenMP.

The worker runs every CPU op on PyTorch's OpenMP pool (GNU libgomp), one thread per core.
Between parallel regions libgomp keeps an idle thread spinning for about 3 ms by default
(``OMP_WAIT_POLICY`` unset). On cores of its own that is the fastest: the next region finds
its threads awake. When other processes share the cores, a spinning thread holds a core
while the thread that owns the next region waits for a time slice, and a passive pool
(threads sleep at once) serves several times the tokens. ``ModelRunConfig.omp_wait_policy``
says which the worker runs with; the figures behind its default are in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger(__name__)

VARIABLE = "OMP_WAIT_POLICY"


def apply_omp_wait_policy(policy: str, environ=os.environ) -> None:
    """Export ``policy`` (passive|active) as OMP_WAIT_POLICY, or leave libgomp its own
    default ("default"). libgomp reads the variable once, when torch loads it."""
    if "torch" in sys.modules:
        logger.warning("OpenMP wait policy %r set after torch was imported: it may not apply", policy)
    if policy == "default":
        environ.pop(VARIABLE, None)
    else:
        environ[VARIABLE] = policy.upper()
