"""The interface a structured-output library implements (xgrammar now; llguidance or
outlines-core could be added behind it).

A backend compiles a ``GrammarSpec`` against the model's vocabulary (CPU work, done
off the step's critical path), makes a ``GrammarMatcher`` per request, and masks a
batch of logits with one token bitmask (one bit per vocabulary id, 1 = allowed).
"""

from __future__ import annotations

import abc
import functools
import sys
from typing import TYPE_CHECKING

from .spec import GrammarSpec

if TYPE_CHECKING:  # the tokenizer service validates specs without importing torch
    import torch


class GrammarError(ValueError):
    """The spec does not compile; the message says what is wrong, for the client."""


class GrammarMatcher(abc.ABC):
    """Where one request is in its grammar: advanced by each sampled token."""

    @abc.abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by ``token_id``; False (and no change) when the grammar forbids it."""

    @abc.abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row ``row`` of ``bitmask``."""

    @abc.abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Forget the last ``num_tokens`` accepted tokens (rejected draft tokens, a
        token the scheduler dropped)."""

    @abc.abstractmethod
    def is_terminated(self) -> bool:
        """Whether a stop token was accepted: the output is complete."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Back to the grammar's start (then replay tokens to rebuild a state)."""


class StructuredOutputBackend(abc.ABC):
    name: str

    @abc.abstractmethod
    def compile(self, spec: GrammarSpec):
        """The compiled grammar (opaque to callers); raises ``GrammarError``."""

    @abc.abstractmethod
    def matcher(self, compiled, stop_token_ids: list[int] | None = None) -> GrammarMatcher:
        """A fresh matcher; ``stop_token_ids`` (default: the vocabulary's) may end the output."""

    @abc.abstractmethod
    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        """A CPU bitmask for ``num_rows`` rows of logits."""

    @abc.abstractmethod
    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Set ``logits[r, t] = -inf`` for each row r in ``rows`` and token t its bitmask row forbids."""


@functools.lru_cache(maxsize=1)
def _byte_to_additive_mask():
    """[256, 8] float: row b holds 0 where bit i of byte b is set, else -inf."""
    import torch

    bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
    return torch.zeros(256, 8).masked_fill_(bits == 0, float("-inf"))


def apply_bitmask_on_cpu(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """``apply_bitmask`` for float32 logits on the CPU: each bitmask byte looks up its 8
    additive masks (0 or -inf) in a table, one gather and one add for all rows. About 4x
    xgrammar's CPU kernel at batch 32 (docs/BENCHMARKS.md); tests compare the two. The
    bitmask's int32 words are read as bytes, so token 8b + i is bit i of byte b on a
    little-endian machine."""
    import torch

    assert sys.byteorder == "little"
    table = _byte_to_additive_mask()
    vocab = logits.shape[1]
    if len(rows) == logits.shape[0]:
        logits.add_(table[bitmask[: len(rows)].view(torch.uint8).long()].view(len(rows), -1)[:, :vocab])
        return
    index = torch.tensor(rows)
    masks = table[bitmask[index].view(torch.uint8).long()].view(len(rows), -1)[:, :vocab]
    logits.index_add_(0, index, masks)
