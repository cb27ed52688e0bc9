"""Turns the last position's logits of each request into its next token.

Order, as in vLLM: min_tokens masking, logit controls (logit_bias, allowed_token_ids,
bad_words) and penalties on the raw logits, then greedy argmax or temperature, min-p,
top-k and top-p, then a draw. The per-row work is ``kernels.sampling``'s (a C kernel on
CPU, Triton on CUDA): no sort of the vocabulary and no noise value per vocabulary entry;
each random row takes ONE uniform and draws by inverse CDF. A seeded request's uniform
comes from its own generator (its tokens do not depend on what else is in the batch),
the others' from the shared one, in row order (alike on every TP rank). Logprobs are of
the raw model distribution (before any processing but a grammar's mask, which the model
runner applies first), like vLLM's default.
"""

from __future__ import annotations

import torch

from kernels.sampling import GREEDY_BELOW, filtered_probs, inverse_cdf_draw, sample
from shared.protocol import Logprobs

from .sampling_metadata import SamplingMetadata


class Sampler:
    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def __call__(self, logits: torch.Tensor, batch: SamplingMetadata):
        """Returns (token ids [B] int64 on CPU, list of Logprobs-or-None per row). ``logits``
        may be changed in place (bans and penalties) unless logprobs are wanted."""
        logits = logits.float()
        raw_logits = logits if batch.num_logprobs is not None else None
        logits = apply_bans_and_penalties(logits, batch, copy=raw_logits is not None)

        if batch.all_greedy:
            sampled = logits.argmax(dim=-1)
        else:
            uniforms = draw_uniforms(batch, logits.shape[0], self.generator, logits.device)
            sampled = sample(logits, batch.temperature, batch.top_k, batch.top_p, batch.min_p, uniforms)
        sampled = sampled.cpu()
        logprobs = None
        if raw_logits is not None:
            logprobs = compute_logprobs(raw_logits, sampled, batch.num_logprobs)
        return sampled, logprobs


def draw_uniforms(batch: SamplingMetadata, num_rows: int, generator: torch.Generator, device) -> torch.Tensor:
    """One uniform in [0, 1) per row (float64): a seeded row's from its own generator, the
    others' from ``generator`` in one call, in row order."""
    if not batch.generators:
        return torch.rand(num_rows, dtype=torch.float64, generator=generator, device=device)
    uniforms = torch.empty(num_rows, dtype=torch.float64, device=device)
    shared_rows = [i for i in range(num_rows) if i not in batch.generators]
    if shared_rows:
        uniforms[shared_rows] = torch.rand(len(shared_rows), dtype=torch.float64, generator=generator, device=device)
    for i, row_generator in batch.generators.items():
        uniforms[i : i + 1] = torch.rand(1, dtype=torch.float64, generator=row_generator, device=device)
    return uniforms


def draw(logits: torch.Tensor, probs: torch.Tensor, batch: SamplingMetadata, generator: torch.Generator) -> torch.Tensor:
    """Each row's token: argmax of ``logits`` for greedy rows, else a draw from ``probs``
    (``to_probs``) with the row's uniform (``draw_uniforms``)."""
    uniforms = draw_uniforms(batch, probs.shape[0], generator, probs.device)
    greedy_rows = (batch.temperature < GREEDY_BELOW).to(logits.device)
    return torch.where(greedy_rows, logits.argmax(dim=-1), inverse_cdf_draw(probs, uniforms))


def skip_draws(generator: torch.Generator, num_tokens: int, device) -> None:
    """Advance a seeded request's generator past the uniforms ``draw_uniforms`` took for
    its first ``num_tokens`` tokens (sampled elsewhere: a worker or engine lost since, or a
    P/D prefill engine), so its next token gets the uniform it would have got there. One
    draw per token, as the sampler draws without speculative decoding (with drafts the
    draws depend on how many were proposed and accepted, which is not known here)."""
    for _ in range(num_tokens):
        torch.rand(1, dtype=torch.float64, generator=generator, device=device)


def apply_bans_and_penalties(logits: torch.Tensor, batch: SamplingMetadata, copy: bool = True) -> torch.Tensor:
    """min_tokens bans, logit controls and penalties on the raw logits (on a copy when
    anything applies, unless ``copy`` is False: then in place)."""
    if copy and (batch.banned or batch.any_penalties or batch.logit_controls):
        logits = logits.clone()
    if batch.banned:
        rows, token_ids = batch.banned
        logits[rows, token_ids] = float("-inf")
    if batch.logit_controls is not None:
        logits = batch.logit_controls.apply(logits)
    if batch.any_penalties:
        apply_penalties(logits, batch)
    return logits


def to_probs(logits: torch.Tensor, batch: SamplingMetadata) -> torch.Tensor:
    """The distribution a random row draws from: temperature (1 for greedy rows), min-p,
    top-k and top-p, softmax."""
    return filtered_probs(logits, batch.temperature, batch.top_k, batch.top_p, batch.min_p)


def apply_penalties(logits: torch.Tensor, batch: SamplingMetadata) -> torch.Tensor:
    """Repetition (prompt and output), frequency and presence (output) penalties, in place,
    touching only the token ids the rows hold (never a [rows, vocab] temporary)."""
    prompt_ids, output_ids = batch.prompt_token_ids, batch.output_token_ids  # -1: padding
    seen_ids = torch.cat([prompt_ids, output_ids], dim=1)
    seen = seen_ids >= 0
    # Padding points at token 0 and writes back what token 0 gets: its penalized value
    # where the row holds token 0, else its own.
    safe_ids = torch.where(seen, seen_ids, 0)
    values = logits.gather(1, safe_ids)
    rep = batch.repetition_penalty.unsqueeze(1)
    penalized = torch.where(values > 0, values / rep, values * rep)
    holds_zero = ((seen_ids == 0) & seen).any(dim=1, keepdim=True)
    logits.scatter_(1, safe_ids, torch.where(seen | holds_zero, penalized, values))

    output = output_ids >= 0
    safe_output = torch.where(output, output_ids, 0)
    frequency = torch.where(output, -batch.frequency_penalty.unsqueeze(1), 0.0)
    logits.scatter_add_(1, safe_output, frequency)
    # Presence: once per distinct id, at its first place in the sorted ids.
    ordered = torch.sort(torch.where(output, output_ids, -1), dim=1).values
    first = ordered >= 0
    first[:, 1:] &= ordered[:, 1:] != ordered[:, :-1]
    presence = torch.where(first, -batch.presence_penalty.unsqueeze(1), 0.0)
    logits.scatter_add_(1, ordered.clamp(min=0), presence)
    return logits


def compute_logprobs(
    raw_logits: torch.Tensor, sampled: torch.Tensor, num_logprobs: list[int]
) -> list[Logprobs | None]:
    logprobs = torch.log_softmax(raw_logits, dim=-1)
    max_n = max(num_logprobs)
    sampled_dev = sampled.to(logprobs.device)
    sampled_lp = logprobs.gather(1, sampled_dev.unsqueeze(1)).squeeze(1)
    ranks = (logprobs > sampled_lp.unsqueeze(1)).sum(dim=-1) + 1
    top_lp, top_ids = (logprobs.topk(max_n, dim=-1) if max_n > 0 else (None, None))
    sampled_list = sampled.tolist()
    sampled_lp = sampled_lp.cpu().tolist()
    ranks = ranks.cpu().tolist()
    if max_n > 0:
        top_lp = top_lp.cpu().tolist()
        top_ids = top_ids.cpu().tolist()
    out: list[Logprobs | None] = []
    for i, n in enumerate(num_logprobs):
        if n < 0:
            out.append(None)
            continue
        out.append(
            Logprobs(
                token_ids=[sampled_list[i]] + (top_ids[i][:n] if n else []),
                logprobs=[sampled_lp[i]] + (top_lp[i][:n] if n else []),
                sampled_rank=ranks[i],
            )
        )
    return out
