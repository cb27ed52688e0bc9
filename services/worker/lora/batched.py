"""The LoRA delta of one fused projection for a batch of tokens under mixed adapters.

Every adapter slot's A and B of a projection live in one tensor each: ``a_slots``
``[S, R, in]`` and ``b_slots`` ``[S, R, out]`` (R: the fused projection's stacked rank,
``adapter.py``; the scaling is folded into B). A step gives each token a slot
(``LoRABatch``: ``token_slot`` ``[T]``, -1 for a token of the base model) and every token
gets ``B_s^T A_s x`` of its own slot ``s``, for any mix of adapters, with no loop over
adapters and no per-step copy of the weights. Four ways (``LoRABatch.method``; by
default ``choose_method``'s, from the measurements in docs/BENCHMARKS.md):

- ``masked`` (CPU): one shrink GEMM over all S slots, each token's row masked to its
  slot (one-hot), one expand GEMM. Cost grows with S, whichever slots the step uses.
- ``grouped`` (CPU): the tokens sorted by slot into a padded ``[G, L, in]`` batch over
  the G slots the step uses, shrink and expand as two batched GEMMs (``torch.bmm``),
  the deltas added back by token index. Cost grows with the tokens (plus padding to the
  largest group), not with S.
- ``bgmv`` (CPU): one C call per projection (``kernels/lora_cpu.py``) that groups the
  tokens by slot itself and reads each slot's A and B in place, skipping the zero blocks
  of a fused projection's block-diagonal B (``out_splits``). No padding, no index tensors.
- ``triton`` (GPU): punica's bgmv idea, ``kernels/lora.py``: shrink and expand kernels
  that read only each token's slot.

``lora_delta_reference`` is the plain per-token gather the tests compare them with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.lora import lora_expand_triton, lora_shrink_triton
from kernels.lora_cpu import add_lora_cpu, lora_cpu_available

METHODS = ("masked", "grouped", "bgmv", "triton")


# bfloat16 steps of at least this many tokens, all under one adapter, go to oneDNN's GEMMs.
GEMM_MIN_TOKENS_ONE_SLOT = 512


def choose_method(device: torch.device, dtype: torch.dtype = torch.float32, num_tokens: int = 0,
                  one_slot: bool = False) -> str:
    """The faster way, as measured (scripts/bench_lora.py --kernels, docs/BENCHMARKS.md,
    "Multi-LoRA kernels: the C kernel"): on CPU the C kernel (``bgmv``) wherever it can be
    built, 1.3-7x faster than grouping at 32-2048 tokens over 4 or 8 adapters and 1.3-2.4x
    at 32 tokens over one; except a bfloat16 step of ``GEMM_MIN_TOKENS_ONE_SLOT`` tokens or more,
    all with one adapter (``one_slot``: a long prefill), where grouping's two plain GEMMs
    won. Without a C compiler: grouping, which beat the masked GEMMs (kept for comparison,
    as ``LoRASlots.method``)."""
    if device.type == "cuda":
        return "triton"
    if not lora_cpu_available(dtype):
        return "grouped"
    if dtype == torch.bfloat16 and one_slot and num_tokens >= GEMM_MIN_TOKENS_ONE_SLOT:
        return "grouped"
    return "bgmv"


@dataclass
class LoRABatch:
    """A step's tokens and their slots, in the forms the methods need (built once per step,
    read by every wrapped projection)."""

    method: str
    token_slot: torch.Tensor  # [T] int64, -1: the base model
    one_hot: torch.Tensor | None = None  # masked: [T, S] rows in the activations' dtype
    # grouped: the slots used (G) and the padded batch of G groups of max_len rows; each
    # token's row in it (``dest``; base-model tokens: the spare row G * max_len, never read),
    # and the tokens with a slot (``order``) with their rows (``rows``).
    groups: torch.Tensor | None = None
    group_range: tuple[int, int] | None = None  # the used slots as a range [lo, hi), if they are one
    max_len: int = 0
    dest: torch.Tensor | None = None
    order: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    single_slot: int | None = None  # grouped: every token has this one slot (plain GEMMs, no gather)

    @classmethod
    def build(cls, token_slot: torch.Tensor, num_slots: int, dtype: torch.dtype, device: torch.device,
              method: str | None = None) -> "LoRABatch":
        """``token_slot``: a host int64 tensor; the result's tensors are on ``device``."""
        has_slot = token_slot >= 0
        used = torch.unique(token_slot[has_slot])  # sorted
        one_slot = len(used) == 1 and bool(has_slot.all())
        if method is None:
            method = choose_method(device, dtype, len(token_slot), one_slot)
        batch = cls(method=method, token_slot=token_slot.to(device))
        if method == "masked":
            one_hot = torch.zeros(len(token_slot), num_slots, dtype=dtype)
            one_hot[has_slot.nonzero().squeeze(1), token_slot[has_slot]] = 1
            batch.one_hot = one_hot.to(device)
        elif method == "grouped":
            order = torch.argsort(token_slot, stable=True)[int((~has_slot).sum()):]
            group_of = torch.searchsorted(used, token_slot[order])
            counts = torch.bincount(group_of, minlength=len(used))
            starts = torch.cumsum(counts, 0) - counts
            batch.max_len = int(counts.max())
            rows = group_of * batch.max_len + torch.arange(len(order)) - starts[group_of]
            dest = torch.full((len(token_slot),), len(used) * batch.max_len, dtype=torch.int64)
            dest[order] = rows
            batch.dest, batch.order, batch.rows = dest.to(device), order.to(device), rows.to(device)
            lo, hi = int(used[0]), int(used[-1]) + 1
            batch.group_range = (lo, hi) if hi - lo == len(used) else None
            batch.groups = used.to(device)
            if one_slot:
                batch.single_slot = int(used[0])
        elif method not in ("bgmv", "triton"):
            raise ValueError(f"unknown LoRA method {method!r} (one of {', '.join(METHODS)})")
        return batch


def add_lora(y: torch.Tensor, x: torch.Tensor, a_slots: torch.Tensor, b_slots: torch.Tensor,
             batch: LoRABatch, out_splits: tuple[int, ...] | None = None) -> torch.Tensor:
    """``y += delta`` in place (and returned): ``y`` ``[T, out]``, ``x`` ``[T, in]``;
    ``out_splits``: the widths of the fused sub-modules' outputs (``bgmv`` skips B's
    zero blocks; the others multiply them)."""
    if batch.method == "bgmv":
        if not add_lora_cpu(y, x, a_slots, b_slots, batch.token_slot, out_splits):
            # Tensors the kernel does not take (strides, dtypes): correct, not fast.
            y += lora_delta_reference(x, a_slots, b_slots, batch.token_slot).to(y.dtype)
        return y
    if batch.method == "masked":
        return add_lora_masked(y, x, a_slots, b_slots, batch.one_hot)
    if batch.method == "grouped":
        return add_lora_grouped(y, x, a_slots, b_slots, batch)
    h = lora_shrink_triton(x, a_slots, batch.token_slot)
    return lora_expand_triton(y, h, b_slots, batch.token_slot)


def add_lora_masked(y: torch.Tensor, x: torch.Tensor, a_slots: torch.Tensor, b_slots: torch.Tensor,
                    one_hot: torch.Tensor) -> torch.Tensor:
    num_slots, rank, in_features = a_slots.shape
    num_tokens = x.shape[0]
    h = x @ a_slots.view(num_slots * rank, in_features).t()
    h = (h.view(num_tokens, num_slots, rank) * one_hot.unsqueeze(-1)).view(num_tokens, num_slots * rank)
    return y.addmm_(h, b_slots.view(num_slots * rank, b_slots.shape[2]))


def add_lora_grouped(y: torch.Tensor, x: torch.Tensor, a_slots: torch.Tensor, b_slots: torch.Tensor,
                     batch: LoRABatch) -> torch.Tensor:
    if batch.single_slot is not None:
        return y.addmm_(x @ a_slots[batch.single_slot].t(), b_slots[batch.single_slot])
    if batch.group_range is not None:  # a view: no copy of the weights
        lo, hi = batch.group_range
        a, b = a_slots[lo:hi], b_slots[lo:hi]
    else:
        a, b = a_slots.index_select(0, batch.groups), b_slots.index_select(0, batch.groups)
    num_rows = a.shape[0] * batch.max_len
    grouped_x = x.new_zeros(num_rows + 1, x.shape[1])
    grouped_x.index_copy_(0, batch.dest, x)  # several base-model tokens may land on the spare row
    grouped_x = grouped_x[:num_rows].view(a.shape[0], batch.max_len, x.shape[1])
    delta = torch.bmm(torch.bmm(grouped_x, a.transpose(1, 2)), b).view(num_rows, b.shape[2])
    return y.index_add_(0, batch.order, delta.index_select(0, batch.rows))


def lora_delta_reference(x: torch.Tensor, a_slots: torch.Tensor, b_slots: torch.Tensor,
                         slot_index: torch.Tensor) -> torch.Tensor:
    """The delta token by token: ``B[s]^T @ A[s] @ x[t]`` for ``s = slot_index[t]`` (-1: zero)."""
    has_slot = slot_index >= 0
    index = slot_index.clamp(min=0)
    h = torch.bmm(a_slots[index], x.unsqueeze(-1))  # [T, R, 1]
    delta = torch.bmm(h.transpose(1, 2), b_slots[index]).squeeze(1)  # [T, out]
    return delta * has_slot.unsqueeze(-1).to(delta.dtype)
