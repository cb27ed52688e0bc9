"""Turns the last position's logits of each request into its next token.

Order, as in vLLM: min_tokens masking, logit controls (logit_bias, allowed_token_ids,
bad_words) and penalties on the raw logits, then greedy
argmax or temperature, min-p, top-k and top-p, then a draw. The draw is an
exponential race (argmax of probs / Exp(1) noise), which is a draw from the
distribution, with the noise of a seeded request taken from its own generator so
its tokens do not depend on what else is in the batch. Logprobs are of the raw
model distribution (before any processing but a grammar's mask, which the model runner
applies first), like vLLM's default.
"""

from __future__ import annotations

import torch

from shared.protocol import Logprobs

from .sampling_metadata import SamplingMetadata


class Sampler:
    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def __call__(self, logits: torch.Tensor, batch: SamplingMetadata):
        """Returns (token ids [B] int64 on CPU, list of Logprobs-or-None per row)."""
        logits = logits.float()
        raw_logits = logits if batch.num_logprobs is not None else None
        logits = apply_bans_and_penalties(logits, batch)

        if batch.all_greedy:
            sampled = logits.argmax(dim=-1)
        else:
            sampled = self._sample(logits, batch)
        sampled = sampled.cpu()
        logprobs = None
        if raw_logits is not None:
            logprobs = compute_logprobs(raw_logits, sampled, batch.num_logprobs)
        return sampled, logprobs

    def _sample(self, logits: torch.Tensor, batch: SamplingMetadata) -> torch.Tensor:
        return draw(logits, to_probs(logits, batch), batch, self.generator)


def draw(logits: torch.Tensor, probs: torch.Tensor, batch: SamplingMetadata, generator: torch.Generator) -> torch.Tensor:
    """Each row's token: argmax of ``logits`` for greedy rows, else a draw from ``probs``
    (``to_probs``) by the exponential race, a seeded row's noise from its own generator
    and the others' from ``generator``."""
    greedy_rows = batch.temperature < 1e-5
    noise = torch.empty_like(probs)
    shared_rows = [i for i in range(probs.shape[0]) if i not in batch.generators]
    if shared_rows:
        noise[shared_rows] = torch.empty(
            len(shared_rows), probs.shape[1], device=probs.device
        ).exponential_(generator=generator)
    for i, row_generator in batch.generators.items():
        noise[i].exponential_(generator=row_generator)
    random_tokens = (probs / noise).argmax(dim=-1)
    greedy_tokens = logits.argmax(dim=-1)
    return torch.where(greedy_rows.to(logits.device), greedy_tokens, random_tokens)


def skip_noise_rows(generator: torch.Generator, num_tokens: int, vocab_size: int, device) -> None:
    """Advance a seeded request's generator past the noise rows ``draw`` took for its first
    ``num_tokens`` tokens (sampled elsewhere: a worker or engine lost since, or a P/D
    prefill engine), so its next token gets the noise it would have got there. One row per
    token, as the sampler draws without speculative decoding (with drafts the draws depend
    on how many were proposed and accepted, which is not known here)."""
    if num_tokens:
        row = torch.empty(vocab_size, device=device)
        for _ in range(num_tokens):
            row.exponential_(generator=generator)


def apply_bans_and_penalties(logits: torch.Tensor, batch: SamplingMetadata) -> torch.Tensor:
    """min_tokens bans, logit controls and penalties on the raw logits (a copy when
    anything applies)."""
    logits = logits.clone() if (batch.banned or batch.any_penalties or batch.logit_controls) else logits
    if batch.banned:
        rows, token_ids = batch.banned
        logits[rows, token_ids] = float("-inf")
    if batch.logit_controls is not None:
        logits = batch.logit_controls.apply(logits)
    if batch.any_penalties:
        logits = apply_penalties(logits, batch)
    return logits


def to_probs(logits: torch.Tensor, batch: SamplingMetadata) -> torch.Tensor:
    """The distribution a random row draws from: temperature (1 for greedy rows), min-p,
    top-k and top-p, softmax."""
    greedy_rows = batch.temperature < 1e-5
    temperature = torch.where(greedy_rows, torch.ones_like(batch.temperature), batch.temperature)
    logits = logits / temperature.unsqueeze(1)
    if batch.any_min_p:
        logits = apply_min_p(logits, batch.min_p)
    if batch.any_top_k or batch.any_top_p:
        logits = apply_top_k_top_p(logits, batch.top_k, batch.top_p)
    return torch.softmax(logits, dim=-1)


def apply_penalties(logits: torch.Tensor, batch: SamplingMetadata) -> torch.Tensor:
    """Repetition (prompt and output), frequency and presence (output) penalties."""
    num_rows, vocab = logits.shape
    output_ids = batch.output_token_ids
    counts = torch.zeros(num_rows, vocab + 1, dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(1, output_ids.clamp(min=-1) % (vocab + 1), torch.ones_like(output_ids, dtype=logits.dtype))
    counts = counts[:, :vocab]  # column `vocab` collected the -1 padding
    seen = torch.zeros(num_rows, vocab + 1, dtype=torch.bool, device=logits.device)
    seen.scatter_(1, batch.prompt_token_ids % (vocab + 1), True)
    seen = seen[:, :vocab] | (counts > 0)

    rep = batch.repetition_penalty.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - batch.frequency_penalty.unsqueeze(1) * counts
    logits = logits - batch.presence_penalty.unsqueeze(1) * (counts > 0).to(logits.dtype)
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    k = torch.where((top_k <= 0) | (top_k > vocab), torch.full_like(top_k, vocab), top_k)
    positions = torch.arange(vocab, device=logits.device).unsqueeze(0)
    drop = positions >= k.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    mass_before = probs.cumsum(dim=-1) - probs
    drop = mass_before >= top_p.unsqueeze(1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)


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
