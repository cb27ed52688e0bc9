"""The experts of a mixture-of-experts MLP, every token through its top-k experts at once.

``fused_moe(x, w13, w2, topk_weights, topk_ids, activation)``: token t's output is
``sum_j topk_weights[t, j] * w2[e] @ act_and_mul(w13[e] @ x[t])`` over its experts
``e = topk_ids[t, j]``, where ``w13[e]`` stacks the expert's gate rows over its up rows
(``[E, 2I, H]``), ``w2`` is ``[E, H, I]`` and ``act_and_mul`` is SiLU (or GELU-tanh) of the
gate times the up half.

- ``fused_moe_ref``: the PyTorch reference and the CPU path. Grouped products: the
  (token, expert) pairs are sorted by expert once, and each expert that any token chose
  multiplies all its tokens in one product (a loop over the experts hit, never over
  tokens). A token's expert outputs are added in ascending expert order starting from
  zero, as Hugging Face's ``index_add_`` over experts adds them, so float32 results match
  its bit for bit.
- ``fused_moe_triton``: the CUDA kernel. The pairs sorted by expert are cut into blocks of
  ``BLOCK_M`` rows of one expert each (each expert's segment padded to a block boundary, as
  vLLM's ``moe_align_block_size``); one grouped GEMM launch computes every block's
  ``x @ w13[e].T``, the activation runs on the result, a second launch computes
  ``@ w2[e].T`` scaled by the routing weight, and the k rows of each token are summed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.triton_import import tl, triton


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's top-k routing (Qwen3-MoE, Mixtral): softmax over the experts in
    float32, the ``top_k`` largest, renormalised to sum to 1 if asked. Returns
    ``(weights [T, k] float32, expert ids [T, k] int64)``."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _act_and_mul(h: torch.Tensor, activation: str) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return (F.silu(gate) if activation == "silu" else F.gelu(gate, approximate="tanh")) * up


def _sorted_pairs(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int):
    """Each token's experts in ascending order (and their weights), and the (token, slot)
    pairs grouped by expert: (ids, weights, pair order, pairs per expert)."""
    ids, slot_order = torch.sort(topk_ids, dim=-1)
    weights = torch.gather(topk_weights, 1, slot_order)
    order = torch.argsort(ids.flatten(), stable=True)
    counts = torch.bincount(ids.flatten(), minlength=num_experts)
    return ids, weights, order, counts


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, activation: str = "silu") -> torch.Tensor:
    """x [T, H] -> [T, H]; see the module docstring."""
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0:
        return torch.zeros_like(x)
    num_experts = w13.shape[0]
    ids, weights, order, counts = _sorted_pairs(topk_ids, topk_weights, num_experts)
    token_of = order // top_k
    y = torch.empty(num_tokens * top_k, x.shape[1], dtype=x.dtype, device=x.device)
    flat_weights = weights.flatten()
    start = 0
    for expert, count in enumerate(counts.tolist()):
        if not count:
            continue
        pairs = order[start:start + count]
        h = _act_and_mul(F.linear(x[token_of[start:start + count]], w13[expert]), activation)
        y[pairs] = F.linear(h, w2[expert]) * flat_weights[pairs, None].to(x.dtype)
        start += count
    y = y.view(num_tokens, top_k, -1)
    out = torch.zeros_like(x)
    for j in range(top_k):  # ascending expert order, from zero (Hugging Face's index_add_)
        out += y[:, j]
    return out


# --------------------------------------------------------------------------- Triton


@triton.jit
def _moe_gemm_kernel(
    a_ptr, b_ptr, c_ptr, weights_ptr,
    pair_rows_ptr,  # [padded pairs]: the (token, slot) pair of each sorted row; -1 for padding
    block_experts_ptr,  # [blocks]: the expert of each block of BLOCK_M sorted rows
    N, K, top_k,
    a_row_stride, b_expert_stride, b_row_stride, c_row_stride,
    A_BY_TOKEN: tl.constexpr,  # A's row of a pair is its token's (x), else the pair's own
    SCALE_BY_WEIGHT: tl.constexpr,  # multiply each row by its pair's routing weight
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    block = tl.program_id(0)
    n_block = tl.program_id(1)
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(pair_rows_ptr + rows)
    valid = pairs >= 0
    pairs = tl.where(valid, pairs, 0).to(tl.int64)
    a_rows = pairs // top_k if A_BY_TOKEN else pairs
    cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_valid = ks < K
        a = tl.load(a_ptr + a_rows[:, None] * a_row_stride + ks[None, :], mask=valid[:, None] & k_valid[None, :],
                    other=0.0)
        b = tl.load(b_ptr + expert * b_expert_stride + cols[None, :] * b_row_stride + ks[:, None],
                    mask=k_valid[:, None] & col_valid[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]: w[e].T
        acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    if SCALE_BY_WEIGHT:
        acc *= tl.load(weights_ptr + pairs, mask=valid, other=0.0)[:, None]
    tl.store(c_ptr + pairs[:, None] * c_row_stride + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=valid[:, None] & col_valid[None, :])


def _aligned_pairs(order: torch.Tensor, counts: torch.Tensor, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs sorted by expert with each expert's segment padded to ``block_m`` rows
    (padding -1), and the expert of each block."""
    device = order.device
    padded = (counts + block_m - 1) // block_m * block_m
    padded_starts = torch.cumsum(padded, 0) - padded
    starts = torch.cumsum(counts, 0) - counts
    expert_of_pair = torch.repeat_interleave(torch.arange(len(counts), device=device), counts)
    position = padded_starts[expert_of_pair] + torch.arange(len(order), device=device) - starts[expert_of_pair]
    rows = torch.full((int(padded.sum()),), -1, dtype=torch.int64, device=device)
    rows[position] = order
    block_experts = torch.repeat_interleave(torch.arange(len(counts), device=device), padded // block_m)
    return rows.to(torch.int32), block_experts.to(torch.int32)


def _grouped_gemm(a, b, c, weights, rows, block_experts, top_k, a_by_token, scale, block_m):
    n, k = b.shape[1], b.shape[2]
    block_n = min(64, triton.next_power_of_2(n))
    block_k = min(32, triton.next_power_of_2(k))
    grid = (len(block_experts), triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](
        a, b, c, weights, rows, block_experts, n, k, top_k,
        a.stride(0), b.stride(0), b.stride(1), c.stride(0),
        A_BY_TOKEN=a_by_token, SCALE_BY_WEIGHT=scale, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, activation: str = "silu", block_m: int = 16) -> torch.Tensor:
    """``fused_moe_ref``'s result (to float rounding) with grouped GEMMs in Triton."""
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0:
        return torch.zeros_like(x)
    assert x.stride(-1) == 1 and w13.is_contiguous() and w2.is_contiguous()
    ids, weights, order, counts = _sorted_pairs(topk_ids, topk_weights, w13.shape[0])
    rows, block_experts = _aligned_pairs(order, counts, block_m)
    flat_weights = weights.flatten().float().contiguous()
    h = torch.empty(num_tokens * top_k, w13.shape[1], dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, h, flat_weights, rows, block_experts, top_k, True, False, block_m)
    act = _act_and_mul(h, activation).contiguous()
    y = torch.empty(num_tokens * top_k, w2.shape[1], dtype=x.dtype, device=x.device)
    _grouped_gemm(act, w2, y, flat_weights, rows, block_experts, top_k, False, True, block_m)
    return y.view(num_tokens, top_k, -1).sum(dim=1)
