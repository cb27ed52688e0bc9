"""Each distinct spec compiled once, in a thread: ``get`` returns at once with a future.

The backend itself is built lazily in the compile thread too (reading the vocabulary
takes a fraction of a second), so a process that never sees a constrained request
never pays for it, and one that does never pays for it on its event loop or in a step.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from .backend import StructuredOutputBackend
from .spec import GrammarSpec

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
