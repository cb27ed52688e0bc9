"""The worker's persistent batch: cached request state kept in fixed rows.

Each scheduled request owns a row: its token ids, how many are computed, its block
table and its sampling settings. Rows change only from the step diff, so building
model inputs is a few vectorised gathers and the sampler's settings are a slice of
preallocated tensors, not a rebuild. Removing a request leaves a hole that
``condense`` fills by moving the last rows down.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from shared.protocol import LoRARequest, SamplingParams

from .logit_controls import LogitControls, has_logit_controls
from .sampling_metadata import SamplingMetadata

# Columns of the float sampling settings, kept in one [rows, 6] tensor so that a
# batch change costs one host-to-device copy, not one per setting.
_FLOAT_PARAMS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


@dataclass
class CachedRequestState:
    """Everything a worker remembers of one request between steps."""

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[list[int]]  # per KV cache group
    num_computed_tokens: int
    eos_token_id: int | None
    generator: torch.Generator | None = None
    output_token_ids: list[int] = field(default_factory=list)
    # Draft tokens proposed after its last sampled token (speculative decoding).
    spec_token_ids: list[int] = field(default_factory=list)
    # Their draft distributions q, [drafts, vocab] (draft_model; None: one-hot drafts).
    spec_token_probs: torch.Tensor | None = None
    # The request's structured-output grammar and matcher (structured_output.RequestGrammar).
    grammar: object | None = None
    lora_request: LoRARequest | None = None  # None: the base model

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class InputBatch:
    def __init__(
        self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int, device: torch.device | str = "cpu",
        num_kv_groups: int = 1,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.device = torch.device(device)
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        # Per KV cache group, each row's block table and its length; group 0's also as
        # ``block_table`` / ``num_blocks`` (the only ones of a model with one group).
        self.block_tables = [np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32) for _ in range(num_kv_groups)]
        self.group_num_blocks = [np.zeros(max_num_reqs, dtype=np.int32) for _ in range(num_kv_groups)]
        self.block_table, self.num_blocks = self.block_tables[0], self.group_num_blocks[0]
        self.req_ids: list[str | None] = []
        self.states: list[CachedRequestState | None] = []
        self.req_id_to_index: dict[str, int] = {}

        # Sampling settings: written when a request gets a row, copied to the device
        # only after the rows changed.
        pin = self.device.type == "cuda"
        self.float_params_cpu_tensor = torch.zeros(
            (max_num_reqs, len(_FLOAT_PARAMS)), dtype=torch.float32, pin_memory=pin
        )
        self.float_params_cpu = self.float_params_cpu_tensor.numpy()
        self.top_k_cpu_tensor = torch.zeros(max_num_reqs, dtype=torch.int64, pin_memory=pin)
        self.top_k_cpu = self.top_k_cpu_tensor.numpy()
        if self.device.type == "cpu":
            self.float_params, self.top_k = self.float_params_cpu_tensor, self.top_k_cpu_tensor
        else:
            self.float_params = torch.zeros_like(self.float_params_cpu_tensor, device=self.device)
            self.top_k = torch.zeros_like(self.top_k_cpu_tensor, device=self.device)
        self.greedy = np.zeros(max_num_reqs, dtype=bool)
        self.num_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)  # -1: no logprobs
        # Only rows that have one: seeded requests, and requests under min_tokens
        # with token ids to hold back (row -> (min_tokens, stop token ids)).
        self.generators: dict[int, torch.Generator] = {}
        self.min_tokens: dict[int, tuple[int, list[int]]] = {}
        # Rows of requests with logit_bias / allowed_token_ids / bad_words.
        self.logit_control_rows: dict[int, CachedRequestState] = {}
        self._sampling_rows_changed = False
        # The last metadata of every row, while no row changed and none has settings that
        # change from step to step (see make_sampling_metadata).
        self._all_rows_metadata: SamplingMetadata | None = None

        # What ``_move`` copies whole from one row to another.
        self._row_arrays = (
            self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens, *self.group_num_blocks,
            self.float_params_cpu, self.top_k_cpu, self.greedy, self.num_logprobs,
        )

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    def add_request(self, state: CachedRequestState) -> int:
        index = len(self.req_ids)
        if index >= self.max_num_reqs:
            raise RuntimeError(f"persistent batch is full ({self.max_num_reqs} rows)")
        self.req_ids.append(state.req_id)
        self.states.append(state)
        self.req_id_to_index[state.req_id] = index
        n = state.num_tokens
        self.token_ids[index, :n] = state.token_ids
        self.num_tokens[index] = n
        self.num_prompt_tokens[index] = state.num_prompt_tokens
        self.num_computed_tokens[index] = state.num_computed_tokens
        self.set_block_ids(index, state.block_ids)
        self._set_sampling_params(index, state)
        return index

    def _set_sampling_params(self, index: int, state: CachedRequestState) -> None:
        params = state.sampling_params
        self.float_params_cpu[index] = [getattr(params, name) for name in _FLOAT_PARAMS]
        self.top_k_cpu[index] = params.top_k
        self.greedy[index] = params.greedy
        self.num_logprobs[index] = -1 if params.logprobs is None else params.logprobs
        if state.generator is not None:
            self.generators[index] = state.generator
        stop_ids = list(params.stop_token_ids)
        if state.eos_token_id is not None and not params.ignore_eos:
            stop_ids.append(state.eos_token_id)
        if params.min_tokens > 0 and stop_ids:
            self.min_tokens[index] = (params.min_tokens, stop_ids)
        if has_logit_controls(params):
            self.logit_control_rows[index] = state
        self._sampling_rows_changed = True
        self._all_rows_metadata = None

    def set_block_ids(self, index: int, block_ids: list[list[int]]) -> None:
        """Row ``index``'s block table of each KV cache group."""
        for table, num_blocks, ids in zip(self.block_tables, self.group_num_blocks, block_ids, strict=True):
            table[index, : len(ids)] = ids
            num_blocks[index] = len(ids)

    def append_block_ids(self, index: int, block_ids: list[list[int]], keep: int | None = None) -> None:
        """Append to each group's table after its first ``keep`` blocks (default: all the
        row has)."""
        for table, num_blocks, ids in zip(self.block_tables, self.group_num_blocks, block_ids, strict=True):
            start = num_blocks[index] if keep is None else min(keep, num_blocks[index])
            table[index, start : start + len(ids)] = ids
            num_blocks[index] = start + len(ids)

    def append_token(self, index: int, token_id: int) -> None:
        self.token_ids[index, self.num_tokens[index]] = token_id
        self.num_tokens[index] += 1

    def remove_request(self, req_id: str) -> None:
        index = self.req_id_to_index.pop(req_id, None)
        if index is not None:
            self.req_ids[index] = None
            self.states[index] = None
            self.generators.pop(index, None)
            self.min_tokens.pop(index, None)
            self.logit_control_rows.pop(index, None)
            self._all_rows_metadata = None

    def condense(self) -> None:
        """Fill holes left by removed requests with rows from the end."""
        holes = [i for i, r in enumerate(self.req_ids) if r is None]
        for hole in holes:
            while self.req_ids and self.req_ids[-1] is None:
                self.req_ids.pop()
                self.states.pop()
            last = len(self.req_ids) - 1
            if hole >= last:
                break
            self._move(last, hole)
        while self.req_ids and self.req_ids[-1] is None:
            self.req_ids.pop()
            self.states.pop()

    def _move(self, src: int, dst: int) -> None:
        req_id = self.req_ids[src]
        n = self.num_tokens[src]
        self.token_ids[dst, :n] = self.token_ids[src, :n]
        for table, num_blocks in zip(self.block_tables, self.group_num_blocks):
            nb = num_blocks[src]
            table[dst, :nb] = table[src, :nb]
        for array in self._row_arrays:
            array[dst] = array[src]
        for by_row in (self.generators, self.min_tokens, self.logit_control_rows):
            if src in by_row:
                by_row[dst] = by_row.pop(src)
        self._sampling_rows_changed = True
        self._all_rows_metadata = None
        self.req_ids[dst] = req_id
        self.states[dst] = self.states[src]
        self.req_id_to_index[req_id] = dst
        self.req_ids.pop()
        self.states.pop()

    # ------------------------------------------------------------------ sampling

    def make_sampling_metadata(self, rows: np.ndarray) -> SamplingMetadata:
        """The sampler's view of ``rows``: the ascending rows that sample this step.

        When every row samples (any step without a prompt chunk) the tensors are
        slices of the device copy of the settings, refreshed only after a change, and
        while no row changed and none has per-step state (penalties' token ids, min_tokens
        bans, logit controls) the last step's metadata is reused whole: built after the
        LM head has swept the caches, it cost ~0.2 ms of a batch-1 step.
        """
        num_reqs = self.num_reqs
        cached = self._all_rows_metadata
        if cached is not None and len(rows) == num_reqs and not self._sampling_rows_changed:
            return cached
        if self._sampling_rows_changed and self.device.type != "cpu":
            self.float_params[:num_reqs].copy_(self.float_params_cpu_tensor[:num_reqs], non_blocking=True)
            self.top_k[:num_reqs].copy_(self.top_k_cpu_tensor[:num_reqs], non_blocking=True)
        self._sampling_rows_changed = False
        # Row of the batch -> row of the metadata (-1: not sampling this step).
        position = np.full(num_reqs, -1)
        position[rows] = np.arange(len(rows))
        if len(rows) == num_reqs:
            float_params, top_k = self.float_params[:num_reqs], self.top_k[:num_reqs]
        else:
            index = torch.from_numpy(rows).to(self.device)
            float_params, top_k = self.float_params[index], self.top_k[index]

        _, top_p, min_p, presence, frequency, repetition = self.float_params_cpu[rows].T
        any_penalties = bool((presence != 0).any() or (frequency != 0).any() or (repetition != 1).any())
        prompt_token_ids, output_token_ids = self._penalty_token_ids(rows) if any_penalties else (None, None)
        num_logprobs = self.num_logprobs[rows]
        metadata = SamplingMetadata(
            **dict(zip(_FLOAT_PARAMS, float_params.unbind(1))),
            top_k=top_k,
            generators={int(position[row]): g for row, g in self.generators.items() if position[row] >= 0},
            all_greedy=bool(self.greedy[rows].all()),
            any_penalties=any_penalties,
            any_top_k=bool((self.top_k_cpu[rows] > 0).any()),
            any_top_p=bool((top_p < 1).any()),
            any_min_p=bool((min_p > 0).any()),
            prompt_token_ids=prompt_token_ids,
            output_token_ids=output_token_ids,
            banned=self._banned_token_ids(position),
            num_logprobs=num_logprobs.tolist() if (num_logprobs >= 0).any() else None,
            logit_controls=self._logit_controls(position),
        )
        if len(rows) == num_reqs and not (any_penalties or self.min_tokens or self.logit_control_rows):
            self._all_rows_metadata = metadata
        return metadata

    def _logit_controls(self, position: np.ndarray) -> LogitControls | None:
        if not self.logit_control_rows:
            return None
        return LogitControls.for_rows(
            {int(position[row]): state for row, state in self.logit_control_rows.items() if position[row] >= 0}
        )

    def _penalty_token_ids(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's prompt token ids and output token ids, padded with -1."""
        num_prompt_tokens = self.num_prompt_tokens[rows]
        return (
            self._padded_token_ids(rows, np.zeros_like(num_prompt_tokens), num_prompt_tokens),
            self._padded_token_ids(rows, num_prompt_tokens, self.num_tokens[rows]),
        )

    def _padded_token_ids(self, rows: np.ndarray, start: np.ndarray, end: np.ndarray) -> torch.Tensor:
        """Token ids ``start[i]:end[i]`` of each row ``rows[i]``, padded with -1."""
        columns = start[:, None] + np.arange(max(1, int((end - start).max())))
        token_ids = self.token_ids[rows[:, None], np.minimum(columns, self.max_model_len - 1)]
        token_ids[columns >= end[:, None]] = -1
        return torch.from_numpy(token_ids).to(self.device)

    def _banned_token_ids(self, position: np.ndarray) -> tuple[list[int], list[int]] | None:
        """(metadata rows, token ids) of the stop ids that min_tokens holds back."""
        rows, token_ids = [], []
        for row, (min_tokens, stop_ids) in self.min_tokens.items():
            if position[row] >= 0 and self.num_tokens[row] - self.num_prompt_tokens[row] < min_tokens:
                rows.extend([int(position[row])] * len(stop_ids))
                token_ids.extend(stop_ids)
        return (rows, token_ids) if rows else None
