"""Grouped LoRA for a batch of tokens under mixed adapters (punica's bgmv idea), for GPU.

Slots: ``a_slots`` ``[S, R, in]`` and ``b_slots`` ``[S, R, out]``; ``token_slot`` ``[T]``
gives each token its slot (-1: the base model, no delta). Two kernels, each reading only
its token's slot, so the cost does not grow with S:

    shrink:  h[t] = A[s_t] @ x[t]              [T, R] float32
    expand:  y[t] += B[s_t]^T @ h[t]           in place; tokens with s_t = -1 untouched

One program per (token, block of R rows) and per (token, block of output columns),
accumulating in float32. ``lora_shrink_ref`` / ``lora_expand_ref`` are the PyTorch
references (a per-token gather of the slots' matrices).
"""

from __future__ import annotations

import torch

from kernels.triton_import import tl, triton


def lora_shrink_ref(x: torch.Tensor, a_slots: torch.Tensor, token_slot: torch.Tensor) -> torch.Tensor:
    """[T, R] float32: A[s_t] @ x[t] (zeros where s_t = -1)."""
    has_slot = (token_slot >= 0).unsqueeze(-1)
    h = torch.bmm(a_slots[token_slot.clamp(min=0)].float(), x.float().unsqueeze(-1)).squeeze(-1)
    return h * has_slot


def lora_expand_ref(y: torch.Tensor, h: torch.Tensor, b_slots: torch.Tensor, token_slot: torch.Tensor) -> torch.Tensor:
    """A new tensor: y[t] + B[s_t]^T @ h[t] (y[t] where s_t = -1), rounded once to y's dtype."""
    has_slot = (token_slot >= 0).unsqueeze(-1)
    delta = torch.bmm(h.float().unsqueeze(1), b_slots[token_slot.clamp(min=0)].float()).squeeze(1)
    return torch.where(has_slot, (y.float() + delta).to(y.dtype), y)


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, slot_ptr, h_ptr,
    in_features, rank,
    x_stride, a_stride_slot, a_stride_row, h_stride,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    # A base-model token (slot -1) reads nothing: every load is masked off.
    k_end = tl.where(slot >= 0, in_features, 0)
    slot = tl.maximum(slot, 0)
    row_mask = rows < rank
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < k_end
        x = tl.load(x_ptr + token * x_stride + ks, mask=k_mask, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + slot * a_stride_slot + rows[:, None] * a_stride_row + ks[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(h_ptr + token * h_stride + rows, acc, mask=row_mask)


@triton.jit
def _lora_expand_kernel(
    h_ptr, b_ptr, slot_ptr, y_ptr,
    out_features, rank,
    h_stride, b_stride_slot, b_stride_row, y_stride,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    # A base-model token (slot -1) reads and writes nothing.
    col_mask = cols < tl.where(slot >= 0, out_features, 0)
    slot = tl.maximum(slot, 0)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        rs = r0 + tl.arange(0, BLOCK_R)
        r_mask = rs < rank
        h = tl.load(h_ptr + token * h_stride + rs, mask=r_mask, other=0.0)
        b = tl.load(b_ptr + slot * b_stride_slot + rs[:, None] * b_stride_row + cols[None, :],
                    mask=r_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(b * h[:, None], axis=0)
    y = tl.load(y_ptr + token * y_stride + cols, mask=col_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + token * y_stride + cols, (y + acc).to(y_ptr.dtype.element_ty), mask=col_mask)


def lora_shrink_triton(x: torch.Tensor, a_slots: torch.Tensor, token_slot: torch.Tensor) -> torch.Tensor:
    """[T, R] float32: A[s_t] @ x[t] (zeros where s_t = -1)."""
    assert x.stride(-1) == 1 and a_slots.is_contiguous()
    num_tokens, in_features = x.shape
    rank = a_slots.shape[1]
    h = torch.empty(num_tokens, rank, dtype=torch.float32, device=x.device)
    if num_tokens:
        block_r = min(triton.next_power_of_2(rank), 64)
        grid = (num_tokens, triton.cdiv(rank, block_r))
        _lora_shrink_kernel[grid](x, a_slots, token_slot, h, in_features, rank, x.stride(0), a_slots.stride(0),
                                  a_slots.stride(1), h.stride(0), BLOCK_R=block_r, BLOCK_K=128)
    return h


def lora_expand_triton(y: torch.Tensor, h: torch.Tensor, b_slots: torch.Tensor, token_slot: torch.Tensor) -> torch.Tensor:
    """y[t] += B[s_t]^T @ h[t] in place (and returned); rows with s_t = -1 untouched."""
    assert y.stride(-1) == 1 and h.is_contiguous() and b_slots.is_contiguous()
    num_tokens, out_features = y.shape
    rank = b_slots.shape[1]
    if num_tokens:
        block_n = min(triton.next_power_of_2(out_features), 256)
        grid = (num_tokens, triton.cdiv(out_features, block_n))
        _lora_expand_kernel[grid](h, b_slots, token_slot, y, out_features, rank, h.stride(0), b_slots.stride(0),
                                  b_slots.stride(1), y.stride(0), BLOCK_N=block_n,
                                  BLOCK_R=min(triton.next_power_of_2(rank), 64))
    return y
