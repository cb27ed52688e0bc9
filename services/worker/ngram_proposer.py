"""The n-gram (prompt lookup) proposer of speculative decoding.

After a request samples, its last n tokens (n from ``prompt_lookup_max`` down to
``prompt_lookup_min``) are looked up earlier in its own tokens, prompt and output; the
tokens that followed the latest earlier occurrence are its draft tokens for the next
step. It needs only the request's token ids, which every worker rank holds, so every
rank proposes the same drafts with no bus traffic; nothing is found, nothing is
proposed and the next step is an ordinary one.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from shared.config import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, token_ids: np.ndarray) -> np.ndarray:
        """Up to ``k`` draft tokens to follow ``token_ids`` (1-D), possibly none."""
        num_tokens = len(token_ids)
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            suffix = token_ids[num_tokens - n :]
            # Every earlier n-gram that a token follows: windows starting before the suffix.
            windows = sliding_window_view(token_ids[: num_tokens - 1], n)
            matches = np.flatnonzero((windows == suffix).all(axis=1))
            if len(matches):
                start = int(matches[-1]) + n
                return token_ids[start : start + self.k].copy()
        return token_ids[:0].copy()
