"""Set the OpenMP wait policy of the worker's threads before torch loads OpenMP.

The worker runs every CPU op on PyTorch's OpenMP pool (GNU libgomp), one thread per core.
Between parallel regions libgomp keeps an idle thread spinning for about 3 ms by default
(``OMP_WAIT_POLICY`` unset), which pays off only when every core is the pool's alone. On
a small machine they are not: the stack's own services (gateway, tokenizer, scheduler,
detokenizer, the worker's event loop) and anything else running need a core between and
during steps, and a spinning thread holds it while the thread that owns the next region
waits for a time slice. ``ModelRunConfig.omp_wait_policy`` says which policy the worker
runs with (the figures behind its default are in docs/BENCHMARKS.md).
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
