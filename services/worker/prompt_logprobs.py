"""Prompt logprobs (vLLM's ``prompt_logprobs``): the model's logprob of each prompt token.

The hidden state at position ``p`` of a prefill chunk predicts token ``p + 1``; so a
chunk covering prompt positions ``[c, c + n)`` yields the logprobs of prompt tokens
``c + 1 .. min(c + n, P - 1)`` (``P`` prompt tokens; the last position predicts the first
output token, which the sampler handles). Raw logprobs (log-softmax of the model's
logits: no grammar, bias, penalty or temperature), each with the prompt token's rank and
the top-n, computed in row slices so a long chunk never holds ``chunk x vocab`` floats at
once. Every TP rank computes the logits (the LM head gathers them collectively); only
rank 0 turns them into logprobs, since only it replies. The scheduler gives a request
that wants them no prefix-cache hit, so every position is computed here.
"""

from __future__ import annotations

import numpy as np
import torch

from shared.protocol import PromptLogprobs

from .input_batch import CachedRequestState
from .sampler import compute_logprobs

# Prompt positions whose logits are materialised at once.
ROWS_PER_SLICE = 256


def wanted(states: list[CachedRequestState], num_computed: np.ndarray, num_scheduled: np.ndarray) -> list[int]:
    """The batch rows whose prompt logprobs this step must compute."""
    return [
        row for row, state in enumerate(states)
        if state.sampling_params.prompt_logprobs is not None and num_scheduled[row]
        and num_computed[row] < state.num_prompt_tokens - 1
    ]


def compute_prompt_logprobs(
    compute_logits, hidden: torch.Tensor, rows: list[int], states: list[CachedRequestState],
    num_computed: np.ndarray, num_scheduled: np.ndarray, want_logprobs: bool,
) -> dict[int, PromptLogprobs]:
    """Row -> the prompt logprobs its chunk yields (empty unless ``want_logprobs``; the
    logits are computed on every rank all the same)."""
    chunk_starts = np.cumsum(num_scheduled) - num_scheduled
    result: dict[int, PromptLogprobs] = {}
    for row in rows:
        state = states[row]
        first = int(num_computed[row])  # the chunk's first position
        last = min(first + int(num_scheduled[row]), state.num_prompt_tokens - 1)  # positions [first, last)
        entries = []
        for lo in range(first, last, ROWS_PER_SLICE):
            hi = min(lo + ROWS_PER_SLICE, last)
            flat = int(chunk_starts[row]) + lo - first
            logits = compute_logits(hidden[flat:flat + hi - lo])
            if not want_logprobs:
                continue
            targets = torch.tensor(state.token_ids[lo + 1:hi + 1], dtype=torch.long)
            entries += compute_logprobs(logits.float(), targets, [state.sampling_params.prompt_logprobs] * (hi - lo))
        if want_logprobs:
            result[row] = PromptLogprobs(first + 1, entries)
    return result
