"""gguf-py's ``GGUFReader`` reading through a plain ndarray view of its memory map.

``GGUFReader`` slices its ``numpy.memmap`` once per metadata value and once per part of
each string: about a million slices for the default model's 49,152-token vocabulary and
its merges. Every slice of a memmap runs ``memmap.__array_finalize__`` and
``memmap.__getitem__`` in Python, which made the header cost ~2 s of CPU in every service
at start-up (and at every restart). A plain ndarray view of the same mapping slices in C
(~0.7 s for the same file); the fields and tensors are the same bytes, and the view keeps
the memmap, so the mapping, alive as its base.
"""

from __future__ import annotations

import numpy as np
from gguf import GGUFReader


class PlainViewGGUFReader(GGUFReader):
    @property
    def data(self) -> np.ndarray:
        return self._plain_data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        # GGUFReader.__init__ assigns its memmap here before parsing through it.
        self._plain_data = value.view(np.ndarray) if isinstance(value, np.memmap) else value
