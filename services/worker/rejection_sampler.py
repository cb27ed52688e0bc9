"""Verifies draft tokens against the target model's distributions (speculative decoding).

A request with ``s`` drafts ``d_0 .. d_{s-1}`` had its last known token and its drafts
scored in one forward pass, so the target gives ``s + 1`` distributions ``p_0 .. p_s``
(``p_j`` is the next token's after ``d_0 .. d_{j-1}``). Draft ``d_j`` is accepted

- greedy: while it equals ``argmax p_j``;
- random: with probability ``min(1, p_j(d_j) / q_j(d_j))``, ``q_j`` being the proposer's
  distribution (one-hot on ``d_j`` for n-gram drafts, so the probability is ``p_j(d_j)``).

At the first rejection ``j`` the request's last token is drawn from the normalised
residual ``max(0, p_j - q_j)`` (``p_j`` with ``d_j`` removed, for one-hot ``q_j``); when all
drafts are accepted, from ``p_s`` (greedy: ``argmax``). This keeps every output token
distributed exactly as the target's own sampling would draw it (Leviathan et al. 2023;
Chen et al. 2023). The last draw is the sampler's: one uniform, inverse CDF.

Everything is vectorised over the batch's rows: rows of all requests' positions lie
flat (``[N, V]``, N = sum of s + 1), acceptance is one comparison, the first rejection
per request a cumulative product over a ``[R, S + 1]`` padded view. Randomness: a
seeded request draws its acceptance uniforms and then its last draw's uniform from its own
generator (its tokens do not depend on the rest of the batch), the others from the shared
one, alike on every rank. ``verify`` is the pure core; ``verify_reference`` is its per-request loop
reference for the tests.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from kernels.sampling import inverse_cdf_draw

from .sampler import apply_bans_and_penalties, to_probs
from .sampling_metadata import SamplingMetadata


@dataclass
class DraftLayout:
    """Where each request's positions lie among the flat rows.

    ``num_drafts[i]`` drafts of request i; its rows are ``row_start[i] .. row_start[i] +
    num_drafts[i]`` (the last one scores the token after every draft). ``draft_ids[r]``
    is the draft row r verifies, -1 for each request's last row.
    """

    num_drafts: torch.Tensor  # [R] int64
    row_start: torch.Tensor  # [R] int64
    row_request: torch.Tensor  # [N] int64: the request of each row
    row_position: torch.Tensor  # [N] int64: 0 .. num_drafts of its request
    draft_ids: torch.Tensor  # [N] int64

    @classmethod
    def from_drafts(cls, drafts: list[list[int]], device: torch.device | str = "cpu") -> "DraftLayout":
        num_drafts = torch.tensor([len(d) for d in drafts], dtype=torch.int64)
        counts = num_drafts + 1
        row_start = torch.cumsum(counts, 0) - counts
        row_request = torch.repeat_interleave(torch.arange(len(drafts)), counts)
        row_position = torch.arange(int(counts.sum())) - row_start[row_request]
        draft_ids = torch.tensor([t for d in drafts for t in (*d, -1)], dtype=torch.int64)
        return cls(*(t.to(device) for t in (num_drafts, row_start, row_request, row_position, draft_ids)))

    @property
    def max_drafts(self) -> int:
        return int(self.num_drafts.max()) if len(self.num_drafts) else 0


def verify(
    layout: DraftLayout,
    target_argmax: torch.Tensor,
    target_probs: torch.Tensor | None,
    greedy: torch.Tensor,
    uniforms: torch.Tensor | None,
    last_uniforms: torch.Tensor | None,
    draft_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The output tokens of each request: ``[R, S + 1]`` padded with -1, and their counts.

    ``target_argmax`` [N]; ``target_probs`` [N, V] (None when every request is greedy);
    ``greedy`` [R] bool; ``uniforms`` [N] in [0, 1); ``last_uniforms`` [R] in [0, 1) (float64)
    for each request's last draw; ``draft_probs`` [N, V] the proposer's q (None: one-hot drafts).
    """
    num_reqs = len(layout.num_drafts)
    draft_ids = layout.draft_ids
    is_draft = draft_ids >= 0
    safe_drafts = draft_ids.clamp(min=0)
    row_greedy = greedy[layout.row_request]
    accepted = target_argmax == draft_ids
    if target_probs is not None:
        p_draft = target_probs.gather(1, safe_drafts.unsqueeze(1)).squeeze(1)
        q_draft = (draft_probs.gather(1, safe_drafts.unsqueeze(1)).squeeze(1) if draft_probs is not None
                   else torch.ones_like(p_draft))
        random_accepted = uniforms * q_draft < p_draft
        accepted = torch.where(row_greedy, accepted, random_accepted)
    accepted &= is_draft

    width = layout.max_drafts + 1
    padded = torch.zeros(num_reqs, width, dtype=torch.int64, device=draft_ids.device)
    padded[layout.row_request, layout.row_position] = accepted.long()
    num_accepted = padded.cumprod(dim=1).sum(dim=1)
    last_rows = layout.row_start + num_accepted

    last_tokens = target_argmax[last_rows]
    if target_probs is not None and not bool(greedy.all()):
        residual = target_probs[last_rows]
        rejected = num_accepted < layout.num_drafts
        if draft_probs is not None:
            residual = torch.where(rejected.unsqueeze(1), (residual - draft_probs[last_rows]).clamp(min=0), residual)
        else:
            rejected_draft = torch.where(rejected, draft_ids[last_rows], -1)
            residual = residual.clone()
            rows = torch.nonzero(rejected_draft >= 0).squeeze(1)
            residual[rows, rejected_draft[rows]] = 0.0
        random_tokens = inverse_cdf_draw(residual, last_uniforms)
        last_tokens = torch.where(greedy, last_tokens, random_tokens)

    columns = torch.arange(width, device=draft_ids.device).unsqueeze(0)
    drafts_padded = torch.full((num_reqs, width), -1, dtype=torch.int64, device=draft_ids.device)
    drafts_padded[layout.row_request, layout.row_position] = draft_ids
    tokens = torch.where(columns < num_accepted.unsqueeze(1), drafts_padded, -1)
    tokens = torch.where(columns == num_accepted.unsqueeze(1), last_tokens.unsqueeze(1), tokens)
    return tokens, num_accepted + 1


def _inverse_cdf_one(weights: torch.Tensor, u) -> int:
    """One row's inverse-CDF draw as a loop: the first token whose cumulative weight
    exceeds u times the total."""
    cumulative = list(itertools.accumulate(weights.double().tolist()))
    target = float(u) * cumulative[-1]
    for token, (total, weight) in enumerate(zip(cumulative, weights.tolist())):
        if total > target and weight > 0:
            return token
    return int(torch.nonzero(weights > 0).max())


def verify_reference(
    drafts: list[list[int]],
    target_probs: list[torch.Tensor],
    greedy: list[bool],
    uniforms: list[torch.Tensor],
    last_uniforms: torch.Tensor,
    draft_probs: list[torch.Tensor] | None = None,
) -> list[list[int]]:
    """``verify`` as a loop over requests and positions: ``target_probs[i]`` is
    [s_i + 1, V], ``uniforms[i]`` [s_i + 1], ``draft_probs[i]`` [s_i, V] or None."""
    outputs = []
    for i, draft in enumerate(drafts):
        p = target_probs[i]
        out = []
        for j, d in enumerate(draft):
            if greedy[i]:
                ok = int(p[j].argmax()) == d
            else:
                q = 1.0 if draft_probs is None else float(draft_probs[i][j, d])
                ok = float(uniforms[i][j]) * q < float(p[j, d])
            if not ok:
                if greedy[i]:
                    out.append(int(p[j].argmax()))
                else:
                    residual = p[j].clone()
                    if draft_probs is None:
                        residual[d] = 0.0
                    else:
                        residual = (residual - draft_probs[i][j]).clamp(min=0)
                    out.append(_inverse_cdf_one(residual, last_uniforms[i]))
                break
            out.append(d)
        else:
            last = p[len(draft)]
            out.append(int(last.argmax()) if greedy[i] else _inverse_cdf_one(last, last_uniforms[i]))
        outputs.append(out)
    return outputs


class RejectionSampler:
    """Processes the target's logits of every position as the sampler does (min_tokens
    bans, penalties, temperature, min-p, top-k, top-p) and verifies the drafts."""

    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator

    def __call__(
        self, logits: torch.Tensor, batch: SamplingMetadata, layout: DraftLayout,
        request_generators: dict[int, torch.Generator], draft_probs: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``logits`` [N, V] and ``batch`` over the flat rows; ``request_generators``:
        request index -> its own generator; ``draft_probs`` [N, V] the drafts' q (None:
        one-hot). Returns ``verify``'s (tokens, counts), on CPU."""
        logits = apply_bans_and_penalties(logits.float(), batch)
        target_argmax = logits.argmax(dim=-1)
        probs = uniforms = last_uniforms = None
        greedy = batch.temperature[layout.row_start] < 1e-5
        if not batch.all_greedy:
            probs = to_probs(logits, batch)
            uniforms, last_uniforms = self._draw(layout, request_generators, probs.device)
        tokens, counts = verify(layout, target_argmax, probs, greedy, uniforms, last_uniforms, draft_probs)
        return tokens.cpu(), counts.cpu()

    def _draw(self, layout: DraftLayout, request_generators: dict[int, torch.Generator], device):
        """Uniforms for every row's acceptance and for every request's last draw."""
        num_rows, num_reqs = len(layout.draft_ids), len(layout.num_drafts)
        uniforms = torch.rand(num_rows, generator=self.generator, device=device)
        shared = [i for i in range(num_reqs) if i not in request_generators]
        last_uniforms = torch.empty(num_reqs, dtype=torch.float64, device=device)
        if shared:
            last_uniforms[shared] = torch.rand(len(shared), dtype=torch.float64, generator=self.generator,
                                               device=device)
        # A seeded request draws one uniform per draft, then its last draw's: with no drafts,
        # the same draw as the plain sampler makes (draw_uniforms), whatever the rest of the
        # batch has.
        for i, generator in request_generators.items():
            start, count = int(layout.row_start[i]), int(layout.num_drafts[i])
            if count:
                uniforms[start : start + count] = torch.rand(count, generator=generator, device=device)
            last_uniforms[i : i + 1] = torch.rand(1, dtype=torch.float64, generator=generator, device=device)
        return uniforms, last_uniforms
