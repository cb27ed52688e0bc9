"""Builds the per-step ``SamplingBatch`` tensors from the cached request states."""

from __future__ import annotations

import torch

from .input_batch import CachedRequestState
from .sampler import SamplingBatch


def _padded(rows: list[list[int]], device) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    out = torch.full((len(rows), width), -1, dtype=torch.int64)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=torch.int64)
    return out.to(device)


def make_sampling_batch(states: list[CachedRequestState], device) -> SamplingBatch:
    params = [s.sampling_params for s in states]
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32)
    presence = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32)
    frequency = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32)
    repetition = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32)
    any_penalties = bool((presence != 0).any() or (frequency != 0).any() or (repetition != 1).any())

    banned_rows, banned_ids = [], []
    for i, (state, p) in enumerate(zip(states, params)):
        if len(state.output_token_ids) < p.min_tokens:
            stop_ids = list(p.stop_token_ids)
            if state.eos_token_id is not None and not p.ignore_eos:
                stop_ids.append(state.eos_token_id)
            banned_rows.extend([i] * len(stop_ids))
            banned_ids.extend(stop_ids)

    want_logprobs = any(p.logprobs is not None for p in params)
    return SamplingBatch(
        temperature=temperature.to(device),
        top_p=top_p.to(device),
        top_k=top_k.to(device),
        min_p=min_p.to(device),
        presence_penalty=presence.to(device),
        frequency_penalty=frequency.to(device),
        repetition_penalty=repetition.to(device),
        generators=[s.generator for s in states],
        all_greedy=all(p.greedy for p in params),
        any_penalties=any_penalties,
        any_top_k=bool((top_k > 0).any()),
        any_top_p=bool((top_p < 1).any()),
        any_min_p=bool((min_p > 0).any()),
        prompt_token_ids=_padded([s.token_ids[: s.num_prompt_tokens] for s in states], device) if any_penalties else None,
        output_token_ids=_padded([s.output_token_ids for s in states], device) if any_penalties else None,
        banned=(banned_rows, banned_ids) if banned_rows else None,
        num_logprobs=[(p.logprobs if p.logprobs is not None else -1) for p in params] if want_logprobs else None,
    )
