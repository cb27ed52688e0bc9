"""The detokenizer service's settings: one frozen dataclass, filled from flags (``__main__``)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import model_setting


@dataclass(frozen=True)
class DetokenizerConfig:
    # Only its tokenizer is loaded.
    model: str = model_setting()
