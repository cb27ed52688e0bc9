"""Speculative decoding on the worker: drafts in, verified tokens out, new drafts proposed.

The worker proposes (``NgramProposer``, or the ``DraftModel`` of the draft_model method)
after a request samples and keeps the drafts in the request's state (a draft model's
with their distributions q); it reports only how many it holds. The scheduler then schedules
up to that many of them as the request's last scheduled tokens (``SchedulerOutput.
num_spec_tokens``), within its token budget, KV slots, max_tokens and max_model_len.
Here the step's drafts are written into the batch's token rows after the known
tokens, so ``_prepare_inputs`` gathers them like any other token and the model scores
the last known token and every draft in one pass; the logits of those ``s + 1``
positions per request go through the ``RejectionSampler``.

Every rank holds the same token ids, proposes the same drafts and draws the same
randomness, so the ranks of a TP group stay in step with no extra bus traffic.

Requests with a structured-output grammar or logit controls get no drafts: their mask
at a draft position would depend on the drafts before it. In a step that verifies
other requests' drafts they sample one token at their single position, with their
grammar mask (``mask_logits``) and controls applied there.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from shared.config import SpeculativeConfig
from shared.protocol import Logprobs, SchedulerOutput

from .draft_model import DraftModel
from .input_batch import CachedRequestState, InputBatch
from .logit_controls import has_logit_controls
from .ngram_proposer import NgramProposer
from .rejection_sampler import DraftLayout, RejectionSampler
from .sampler import compute_logprobs
from .sampling_metadata import SamplingMetadata


class SpecDecoder:
    def __init__(
        self, config: SpeculativeConfig, generator: torch.Generator, device: torch.device,
        draft_model: DraftModel | None = None,
    ) -> None:
        if (config.method == "draft_model") != (draft_model is not None):
            raise ValueError(f"method {config.method!r} with draft model {draft_model}")
        self.config = config
        self.proposer = NgramProposer(config)
        self.draft_model = draft_model
        self.rejection_sampler = RejectionSampler(generator)
        self.device = device

    def place_drafts(self, batch: InputBatch, out: SchedulerOutput) -> np.ndarray:
        """Write each request's scheduled drafts after its known tokens; the number of
        drafts per batch row."""
        num_spec = np.zeros(batch.num_reqs, dtype=np.int64)
        for req_id, n in zip(out.scheduled_req_ids, out.num_spec_tokens):
            if not n:
                continue
            row = batch.req_id_to_index[req_id]
            drafts = batch.states[row].spec_token_ids
            if len(drafts) < n:
                raise ValueError(f"step {out.step_id} schedules {n} drafts of {req_id}, this worker holds "
                                 f"{len(drafts)}")
            start = batch.num_tokens[row]
            batch.token_ids[row, start : start + n] = drafts[:n]
            num_spec[row] = n
        return num_spec

    def sample(
        self, compute_logits, hidden: torch.Tensor, batch: InputBatch, num_scheduled: np.ndarray,
        num_spec: np.ndarray, rows: np.ndarray, want_logprobs: bool, mask_logits=None,
    ) -> dict[int, tuple[list[int], list[Logprobs]]]:
        """Verify the drafts of the batch rows ``rows`` (their known tokens are all
        computed now): row -> (its output tokens, their logprobs). ``mask_logits(logits,
        {logits row: request state})`` masks the rows of requests without drafts by
        their grammars, in place."""
        last_positions = np.cumsum(num_scheduled)[rows] - 1
        drafts = [
            batch.token_ids[row, batch.num_tokens[row] : batch.num_tokens[row] + num_spec[row]].tolist()
            for row in rows.tolist()
        ]
        layout = DraftLayout.from_drafts(drafts, self.device)
        num_drafts = num_spec[rows]
        hidden_rows = np.repeat(last_positions - num_drafts, num_drafts + 1) + layout.row_position.cpu().numpy()
        raw_logits = compute_logits(hidden[torch.from_numpy(hidden_rows).to(self.device)]).float()
        if mask_logits is not None:
            row_start = layout.row_start.tolist()
            mask_logits(raw_logits, {row_start[i]: batch.states[row] for i, row in enumerate(rows.tolist())
                                     if num_drafts[i] == 0})
        request_batch = batch.make_sampling_metadata(rows)
        positions_batch = self._per_position(request_batch, batch, rows, layout)
        draft_probs = None
        if self.draft_model is not None and not request_batch.all_greedy:
            draft_probs = self._draft_probs([batch.states[row] for row in rows.tolist()], layout, raw_logits.shape[1])
        tokens, counts = self.rejection_sampler(raw_logits, positions_batch, layout, request_batch.generators,
                                                draft_probs)

        tokens, counts = tokens.tolist(), counts.tolist()
        logprobs: list[list[Logprobs]] = [[] for _ in rows]
        if want_logprobs and request_batch.num_logprobs is not None:
            logprobs = self._logprobs(raw_logits, layout, tokens, counts, request_batch.num_logprobs)
        return {row: (tokens[i][: counts[i]], logprobs[i]) for i, row in enumerate(rows.tolist())}

    def _draft_probs(self, states: list[CachedRequestState], layout: DraftLayout, vocab: int) -> torch.Tensor:
        """q of every flat row: the draft model's distribution of each draft (one-hot
        where a request holds none), zeros on each request's last row."""
        q = torch.zeros(len(layout.draft_ids), vocab, device=self.device)
        for i, (state, start, count) in enumerate(zip(states, layout.row_start.tolist(), layout.num_drafts.tolist())):
            if not count:
                continue
            if state.spec_token_probs is not None:
                q[start : start + count] = state.spec_token_probs[:count]
            else:
                q[torch.arange(start, start + count, device=self.device), layout.draft_ids[start : start + count]] = 1.0
        return q

    def _per_position(
        self, request_batch: SamplingMetadata, batch: InputBatch, rows: np.ndarray, layout: DraftLayout
    ) -> SamplingMetadata:
        """The requests' settings repeated for each of their positions; position j of a
        request counts its drafts before j as output (penalties, min_tokens)."""
        row_request = layout.row_request
        expand = {
            name: getattr(request_batch, name)[row_request]
            for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                         "repetition_penalty")
        }
        output_token_ids = prompt_token_ids = None
        if request_batch.any_penalties:
            prompt_token_ids = request_batch.prompt_token_ids[row_request]
            width = layout.max_drafts
            columns = torch.arange(width, device=self.device).unsqueeze(0)
            drafts_padded = torch.full((len(rows), max(width, 1)), -1, dtype=torch.int64, device=self.device)
            is_draft = layout.draft_ids >= 0
            drafts_padded[row_request[is_draft], layout.row_position[is_draft]] = layout.draft_ids[is_draft]
            earlier_drafts = torch.where(columns < layout.row_position.unsqueeze(1),
                                         drafts_padded[row_request][:, :width], -1)
            output_token_ids = torch.cat([request_batch.output_token_ids[row_request], earlier_drafts], dim=1)
        controls = request_batch.logit_controls
        if controls is not None:  # their requests have no drafts: request i's one position is row_start[i]
            controls = controls.moved_to(layout.row_start.tolist())
        return replace(
            request_batch, **expand, generators={}, prompt_token_ids=prompt_token_ids,
            output_token_ids=output_token_ids, banned=self._banned(batch, rows, layout), num_logprobs=None,
            logit_controls=controls,
        )

    @staticmethod
    def _banned(batch: InputBatch, rows: np.ndarray, layout: DraftLayout) -> tuple[list[int], list[int]] | None:
        """(flat rows, token ids) of the stop ids min_tokens holds back at each position."""
        flat_rows, token_ids = [], []
        row_start = layout.row_start.tolist()
        num_drafts = layout.num_drafts.tolist()
        for i, row in enumerate(rows.tolist()):
            if row not in batch.min_tokens:
                continue
            min_tokens, stop_ids = batch.min_tokens[row]
            num_output = int(batch.num_tokens[row] - batch.num_prompt_tokens[row])
            for position in range(min(num_drafts[i] + 1, max(0, min_tokens - num_output))):
                flat_rows.extend([row_start[i] + position] * len(stop_ids))
                token_ids.extend(stop_ids)
        return (flat_rows, token_ids) if flat_rows else None

    @staticmethod
    def _logprobs(raw_logits, layout: DraftLayout, tokens, counts, num_logprobs) -> list[list[Logprobs]]:
        """Logprobs of the raw distribution at each output token's position."""
        row_start = layout.row_start.tolist()
        flat_rows = [row_start[i] + j for i, count in enumerate(counts) for j in range(count)]
        flat_tokens = torch.tensor([t for i, count in enumerate(counts) for t in tokens[i][:count]])
        flat_n = [num_logprobs[i] for i, count in enumerate(counts) for _ in range(count)]
        flat = compute_logprobs(raw_logits[torch.tensor(flat_rows, device=raw_logits.device)], flat_tokens, flat_n)
        out, start = [], 0
        for count in counts:
            out.append([lp for lp in flat[start : start + count] if lp is not None])
            start += count
        return out

    def propose(self, batch: InputBatch, rows, num_scheduled: np.ndarray) -> dict[int, int]:
        """New drafts for the batch rows that just sampled: row -> how many. A draft model
        also catches up on every row's positions computed this step (``num_scheduled``)."""
        may_draft = {row: self._may_draft(batch.states[row]) for row in rows}
        if self.draft_model is not None:
            return self.draft_model.propose(batch, num_scheduled, list(rows), may_draft)
        counts = {}
        for row, allowed in may_draft.items():
            state = batch.states[row]
            drafts = self.proposer.propose(batch.token_ids[row, : batch.num_tokens[row]]).tolist() if allowed else []
            state.spec_token_ids = drafts
            counts[row] = len(drafts)
        return counts

    @staticmethod
    def _may_draft(state: CachedRequestState) -> bool:
        """Requests with a grammar or logit controls get no drafts (module docstring)."""
        return state.grammar is None and not has_logit_controls(state.sampling_params)
