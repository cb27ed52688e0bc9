"""The worker's persistent batch: cached request state kept in fixed numpy rows.

Each scheduled request owns a row: its token ids, how many are computed, its block
table and its sampling settings. Rows change only from the step diff, so building
model inputs is a few vectorised gathers, not a rebuild. Removing a request leaves
a hole that ``condense`` fills by moving the last rows down.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from shared.protocol import SamplingParams


@dataclass
class CachedRequestState:
    """Everything a worker remembers of one request between steps."""

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_id: int | None
    generator: torch.Generator | None = None
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)
        self.req_ids: list[str | None] = []
        self.states: list[CachedRequestState | None] = []
        self.req_id_to_index: dict[str, int] = {}

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
        self.num_computed_tokens[index] = state.num_computed_tokens
        self.set_block_ids(index, state.block_ids)
        return index

    def set_block_ids(self, index: int, block_ids: list[int]) -> None:
        self.block_table[index, : len(block_ids)] = block_ids
        self.num_blocks[index] = len(block_ids)

    def append_block_ids(self, index: int, block_ids: list[int]) -> None:
        start = self.num_blocks[index]
        self.block_table[index, start : start + len(block_ids)] = block_ids
        self.num_blocks[index] = start + len(block_ids)

    def append_token(self, index: int, token_id: int) -> None:
        self.token_ids[index, self.num_tokens[index]] = token_id
        self.num_tokens[index] += 1

    def remove_request(self, req_id: str) -> None:
        index = self.req_id_to_index.pop(req_id, None)
        if index is not None:
            self.req_ids[index] = None
            self.states[index] = None

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
        self.num_tokens[dst] = n
        self.num_computed_tokens[dst] = self.num_computed_tokens[src]
        nb = self.num_blocks[src]
        self.block_table[dst, :nb] = self.block_table[src, :nb]
        self.num_blocks[dst] = nb
        self.req_ids[dst] = req_id
        self.states[dst] = self.states[src]
        self.req_id_to_index[req_id] = dst
        self.req_ids.pop()
        self.states.pop()
