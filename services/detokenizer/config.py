"""The detokenizer service's settings: one frozen dataclass, filled from flags (``__main__``)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import model_setting, setting


@dataclass(frozen=True)
class DetokenizerConfig:
    # Only its tokenizer is loaded.
    model: str = model_setting()
    stop_strings_cache_chars: int = setting(
        1 << 24, "characters of stop strings each replica keeps (LRU; evicted ones are asked for again)"
    )
    stop_strings_timeout: float = setting(
        2.0, "seconds to wait for a scheduler's answer about stop strings this replica missed"
    )
