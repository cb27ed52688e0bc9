"""The draft_model proposer of speculative decoding: a small model beside the target.

The draft model (``SpeculativeConfig.model``, with the target's tokenizer) is loaded on
every worker rank, whole (never sharded: it is small, and every rank then proposes the
same drafts from the same inputs with no collective). Its paged KV cache is its own
tensors, indexed by the SAME block ids and slot mapping as the target's: position p of
a request lives in the same slot of both caches, so the scheduler's block tables, prefix
cache, preemption and rollback govern both, and the pool has as many draft blocks as
target blocks (``ModelRunner`` counts both when it sizes the pool).

Each step, after the target verified and the request state holds the accepted tokens:

1. **Catch-up**: one forward of the draft over every position the target computed this
   step that is now known (prompt chunks, the last known token, accepted drafts), plus
   the token just sampled. So the draft cache holds every computed position, as the
   target's does (a prefix-cache hit reuses both), and the last row's logits give the
   first draft's distribution.
2. **Proposing**: ``k - 1`` more forwards of one token per proposing request, each
   feeding the draft just drawn.

A draft is drawn from ``q``, the draft model's distribution after the request's
temperature, min-p, top-k and top-p (argmax for greedy requests), by the sampler's
inverse CDF with one uniform: a seeded request draws it from its own generator, the others
from the shared one, alike on every rank. ``q`` stays with the request (``spec_token_probs``) for
the rejection sampler's min(1, p/q) test and residual.

Positions past the request's allocated blocks (the token just sampled after a fully
accepted run, and the proposing positions) use per-row scratch blocks past the shared
pool: what is written there is never read after the step. Positions inside the request's
own blocks past its computed tokens are scratch too: the next step's catch-up rewrites
them once the target has computed them.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from kernels import AttentionMetadata, KernelOps
from shared.config import ConfigError, SpeculativeConfig
from shared.model_config import ModelConfig
from shared.model_files import load_model_config
from shared.tokenizer import load_tokenizer

from .input_batch import InputBatch
from .kv_cache import allocate_kv_caches, kv_block_bytes
from .models.base import CausalLM
from .sampler import draw, to_probs

logger = logging.getLogger(__name__)


def check_same_vocabulary(target_path: str, target: ModelConfig, draft_path: str, draft: ModelConfig) -> None:
    """ConfigError unless the draft model has the target's vocabulary and tokenizer."""
    if draft.vocab_size != target.vocab_size:
        raise ConfigError(f"speculative_config: the draft model {draft_path} has a vocabulary of {draft.vocab_size} "
                          f"tokens, the target {target_path} {target.vocab_size}; they must share the tokenizer")
    target_vocab = load_tokenizer(target_path).backend.get_vocab(with_added_tokens=True)
    draft_vocab = load_tokenizer(draft_path).backend.get_vocab(with_added_tokens=True)
    if draft_vocab != target_vocab:
        differing = sorted(set(draft_vocab.items()) ^ set(target_vocab.items()), key=lambda item: item[1])
        raise ConfigError(f"speculative_config: the draft model {draft_path} has another tokenizer than the target "
                          f"{target_path} ({len(differing)} token/id pairs differ, e.g. {differing[:3]})")


class DraftModel:
    """The draft model of one worker rank, its KV cache and its proposing."""

    def __init__(
        self, config: SpeculativeConfig, model: CausalLM, model_config: ModelConfig, ops: KernelOps,
        generator: torch.Generator, block_size: int, max_num_seqs: int, max_model_len: int,
    ) -> None:
        if model.kv_layout.is_hybrid:
            raise ConfigError(f"speculative_config: the draft model {config.model} has sliding-window attention, "
                              "which a draft model's cache does not support")
        if model_config.max_position_embeddings < max_model_len:
            raise ConfigError(f"speculative_config: the draft model {config.model} has "
                              f"{model_config.max_position_embeddings} positions, fewer than max_model_len "
                              f"{max_model_len}; lower --max-model-len")
        self.path = config.model
        self.k = config.num_speculative_tokens
        self.model = model
        self.model_config = model_config
        self.ops = ops
        self.generator = generator
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        # Scratch blocks per batch row: the token just sampled plus k - 1 proposing positions
        # may reach k positions past the row's blocks.
        self.scratch_per_row = -(-self.k // block_size) + 1
        self.num_blocks = 0
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    @staticmethod
    def load_config(config: SpeculativeConfig, target_path: str, target: ModelConfig) -> ModelConfig:
        """The draft model's config, once its vocabulary is checked against the target's."""
        draft = load_model_config(config.model)
        check_same_vocabulary(target_path, target, config.model, draft)
        return draft

    # ------------------------------------------------------------------ KV cache

    def kv_block_bytes(self) -> int:
        cfg = self.model_config
        return kv_block_bytes(self.block_size, cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers,
                              self.dtype)

    def scratch_bytes(self) -> int:
        return self.max_num_seqs * self.scratch_per_row * self.kv_block_bytes()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """A cache for the pool's ``num_blocks`` blocks (the same ids as the target's) and
        the rows' scratch blocks after them."""
        cfg = self.model_config
        self.num_blocks = num_blocks
        total = num_blocks + self.max_num_seqs * self.scratch_per_row
        self.kv_caches = allocate_kv_caches(total, self.block_size, cfg.num_key_value_heads, cfg.head_dim,
                                            cfg.num_hidden_layers, self.dtype, self.device)

    # ------------------------------------------------------------------ proposing

    def propose(
        self, batch: InputBatch, num_scheduled: np.ndarray, sampled_rows: list[int], proposing: dict[int, bool]
    ) -> dict[int, int]:
        """Catch up on this step's positions and propose drafts for the rows in
        ``proposing`` that may draft: row -> how many drafts it now holds."""
        num_reqs = batch.num_reqs
        starts = batch.num_computed_tokens[:num_reqs].copy()
        ends = starts + num_scheduled
        sampled = np.zeros(num_reqs, dtype=bool)
        sampled[sampled_rows] = True
        # A row that sampled: its known tokens now end with the token just sampled.
        ends[sampled] = batch.num_tokens[:num_reqs][sampled]
        num_output = batch.num_tokens[:num_reqs] - batch.num_prompt_tokens[:num_reqs]
        limits = {}
        for row, may_draft in proposing.items():
            state = batch.states[row]
            state.spec_token_ids, state.spec_token_probs = [], None
            max_tokens = state.sampling_params.max_tokens
            limit = min(self.k, self.max_model_len - int(ends[row]) - 1, max_tokens - int(num_output[row]) - 1)
            if may_draft and limit > 0:
                limits[row] = limit
        block_table = self._block_table(batch, int(ends.max()) + self.k)

        # Catch-up over every row's positions [start, end).
        counts = ends - starts
        hidden, cu = self._forward(batch, block_table, np.arange(num_reqs), starts, counts)
        rows = np.array(sorted(limits), dtype=np.int64)
        if not len(rows):
            return {row: 0 for row in proposing}
        last = torch.from_numpy(cu[rows] - 1).to(self.device)
        logits = self.model.compute_logits(hidden[last])
        drafts = np.zeros((len(rows), self.k), dtype=np.int64)
        probs: list[list[torch.Tensor | None]] = [[] for _ in rows]
        row_limits = np.array([limits[row] for row in rows.tolist()])
        for j in range(int(row_limits.max())):
            active = np.flatnonzero(row_limits > j)
            if j > 0:
                active_rows = rows[active]
                hidden, _ = self._forward(batch, block_table, active_rows, ends[active_rows] - 1 + j,
                                          np.ones(len(active), dtype=np.int64), input_ids=drafts[active, j - 1])
                logits = self.model.compute_logits(hidden)
            tokens, q = self._draw(batch, rows[active], logits)
            drafts[active, j] = tokens
            for i, index in enumerate(active.tolist()):
                probs[index].append(None if q is None else q[i])

        counts_out = {row: 0 for row in proposing}
        for i, row in enumerate(rows.tolist()):
            state = batch.states[row]
            state.spec_token_ids = drafts[i, : row_limits[i]].tolist()
            if all(p is not None for p in probs[i]):
                state.spec_token_probs = torch.stack(probs[i])
            counts_out[row] = int(row_limits[i])
        return counts_out

    def _draw(self, batch: InputBatch, rows: np.ndarray, logits: torch.Tensor):
        """Drafts for ``rows`` (ascending) and their distributions q ([n, V], None when all
        are greedy; a greedy row's q is never read)."""
        logits = logits.float()
        metadata = batch.make_sampling_metadata(rows)
        if metadata.all_greedy:
            return logits.argmax(dim=-1).cpu().numpy(), None
        probs = to_probs(logits, metadata)
        return draw(logits, probs, metadata, self.generator).cpu().numpy(), probs

    def _block_table(self, batch: InputBatch, max_position: int) -> np.ndarray:
        """The rows' block tables, each continued by its scratch blocks past its own."""
        num_reqs = batch.num_reqs
        width = min(-(-max_position // self.block_size), batch.block_table.shape[1])
        past_own = np.arange(width)[None, :] - batch.num_blocks[:num_reqs, None]
        scratch = self.num_blocks + np.arange(num_reqs)[:, None] * self.scratch_per_row + past_own
        # Never more than scratch_per_row blocks past a row's own: see scratch_per_row.
        scratch = np.where(past_own < self.scratch_per_row, scratch, 0)
        return np.where(past_own < 0, batch.block_table[:num_reqs, :width], scratch).astype(np.int32)

    def _forward(
        self, batch: InputBatch, block_table: np.ndarray, rows: np.ndarray, starts: np.ndarray, counts: np.ndarray,
        input_ids: np.ndarray | None = None,
    ) -> tuple[torch.Tensor, np.ndarray]:
        """The draft's hidden states of ``counts[i]`` tokens of each row ``rows[i]`` from
        position ``starts[i]`` (token ids from the batch, or ``input_ids``), and the
        cumulative token counts."""
        cu = np.cumsum(counts)
        total = int(cu[-1])
        index = np.repeat(np.arange(len(rows)), counts)
        positions = starts[index] + np.arange(total) - np.repeat(cu - counts, counts)
        batch_rows = rows[index]
        if input_ids is None:
            input_ids = batch.token_ids[batch_rows, positions]
        table = block_table[rows]
        blocks = table[index, positions // self.block_size].astype(np.int64)
        seq_lens = starts + counts
        dev = self.device
        attn = AttentionMetadata(
            slot_mapping=torch.from_numpy(blocks * self.block_size + positions % self.block_size).to(dev),
            block_tables=torch.from_numpy(np.ascontiguousarray(table)).to(dev),
            query_start_loc=torch.from_numpy(np.concatenate([[0], cu]).astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            max_query_len=int(counts.max()),
            max_seq_len=int(seq_lens.max()),
        )
        hidden = self.model(torch.from_numpy(np.ascontiguousarray(input_ids)).to(dev),
                            torch.from_numpy(positions).to(dev), [attn], self.kv_caches)
        return hidden, cu
