"""Each distinct spec compiled once, in a thread: ``get`` returns at once with a future.

The backend itself is built in the compile thread too: lazily, by the first compile, or
at start-up by ``warm_up`` (the services' ``--structured-outputs-warmup``, so that the
first constrained request does not wait for xgrammar's import). Either way it is never
built on an event loop or in a step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from .backend import StructuredOutputBackend
from .spec import GrammarSpec

logger = logging.getLogger(__name__)

# Compiled grammars kept (least recently used dropped first); a JSON schema's takes
# tens to hundreds of KiB.
MAX_CACHED_GRAMMARS = 256


class GrammarCompileCache:
    def __init__(self, make_backend: Callable[[], StructuredOutputBackend], max_workers: int = 1,
                 max_entries: int = MAX_CACHED_GRAMMARS) -> None:
        self._make_backend = make_backend
        self._backend: StructuredOutputBackend | None = None
        self._lock = threading.Lock()
        self._futures: OrderedDict[GrammarSpec, Future] = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar-compile")
        self.max_entries = max_entries

    @property
    def backend(self) -> StructuredOutputBackend:
        """The backend, built on first use (blocks; call from a compile thread)."""
        with self._lock:
            if self._backend is None:
                self._backend = self._make_backend()
            return self._backend

    def warm_up(self) -> Future:
        """Build the backend now, in the compile thread (a compile asked for meanwhile waits
        for it, as it would have to anyway). Its end is logged; a failure only so: the first
        constrained request meets it again."""
        return self._pool.submit(self._build_logged)

    def _build_logged(self) -> StructuredOutputBackend:
        started = time.monotonic()
        try:
            backend = self.backend
        except Exception as e:
            logger.warning("structured-output backend not built at start-up: %s", e)
            raise
        logger.info("structured-output backend ready (%s, %.1f s)", backend.name, time.monotonic() - started)
        return backend

    def get(self, spec: GrammarSpec) -> Future:
        """The compiled grammar of ``spec`` (a future; its exception is a GrammarError).
        A spec that failed to compile is not kept: asking again compiles again."""
        with self._lock:
            future = self._futures.get(spec)
            if future is not None and not (future.done() and future.exception() is not None):
                self._futures.move_to_end(spec)
                return future
            future = self._pool.submit(self._compile, spec)
            self._futures[spec] = future
            while len(self._futures) > self.max_entries:
                self._futures.popitem(last=False)
            return future

    def _compile(self, spec: GrammarSpec):
        return self.backend.compile(spec)

    def __len__(self) -> int:
        return len(self._futures)
