"""The sampler's view of one step: per-row settings of the rows that sample.

``InputBatch.make_sampling_metadata`` builds it from the persistent batch's rows
(row i here is the i-th sampled request of the step), so the sampler never
reads request objects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .logit_controls import LogitControls


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [B] float32; 0 = greedy
    top_p: torch.Tensor  # [B]
    top_k: torch.Tensor  # [B] int64; <= 0 or >= vocab = off
    min_p: torch.Tensor  # [B]
    presence_penalty: torch.Tensor  # [B]
    frequency_penalty: torch.Tensor  # [B]
    repetition_penalty: torch.Tensor  # [B]
    # Rows of seeded requests -> their own generator; other rows draw from the sampler's.
    generators: dict[int, torch.Generator]
    all_greedy: bool
    any_penalties: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    # Only when any_penalties: padded token ids (-1 = pad) per row.
    prompt_token_ids: torch.Tensor | None = None
    output_token_ids: torch.Tensor | None = None
    # Token ids banned this step (EOS / stop ids under min_tokens): (rows, token ids).
    banned: tuple[list[int], list[int]] | None = None
    # Number of top logprobs per row (-1: none); None when no row wants logprobs.
    num_logprobs: list[int] | None = None
    # logit_bias / allowed_token_ids / bad_words of the rows that have them.
    logit_controls: LogitControls | None = None
