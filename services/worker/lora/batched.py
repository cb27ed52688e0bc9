"""The LoRA delta of one fused projection for a batch of tokens under mixed adapters.

Every adapter slot's A and B of a projection live in one tensor each: ``a_slots``
``[S, R, in]`` and ``b_slots`` ``[out, S, R]`` (R: the fused projection's stacked rank,
``adapter.py``). A step gives each token a one-hot row over the slots (``token_slots``
``[T, S]``: all zero for a token of the base model). Then

    shrink:  h = x @ a_slots.view(S * R, in).T            [T, S * R]  one GEMM
    select:  h[t, s, :] *= token_slots[t, s]               keeps only the token's slot
    expand:  y += h @ b_slots.view(out, S * R).T           one GEMM

gives every token ``B_s @ A_s @ x`` of its own slot ``s`` (scaling is folded into B), for
any mix of adapters, with no loop over adapters and no per-step copy of the weights. The
cost grows with the number of slots (``--max-loras``); a grouped kernel that reads only
the token's slot (punica's sgmv / bgmv) is the GPU path still to write.
``lora_delta_reference`` is the plain per-token gather the tests compare it with.
"""

from __future__ import annotations

import torch


def add_lora(y: torch.Tensor, x: torch.Tensor, a_slots: torch.Tensor, b_slots: torch.Tensor,
             token_slots: torch.Tensor) -> torch.Tensor:
    """``y += delta`` in place (and returned): ``y`` ``[T, out]``, ``x`` ``[T, in]``,
    ``token_slots`` ``[T, S]`` one-hot (or zero) rows in ``x``'s dtype."""
    num_slots, rank, in_features = a_slots.shape
    num_tokens = x.shape[0]
    h = x @ a_slots.view(num_slots * rank, in_features).t()
    h = (h.view(num_tokens, num_slots, rank) * token_slots.unsqueeze(-1)).view(num_tokens, num_slots * rank)
    return y.addmm_(h, b_slots.view(b_slots.shape[0], num_slots * rank).t())


def lora_delta_reference(x: torch.Tensor, a_slots: torch.Tensor, b_slots: torch.Tensor,
                         slot_index: torch.Tensor) -> torch.Tensor:
    """The delta token by token: ``B[s] @ A[s] @ x[t]`` for ``s = slot_index[t]`` (-1: zero)."""
    has_slot = slot_index >= 0
    index = slot_index.clamp(min=0)
    a = a_slots[index]  # [T, R, in]
    b = b_slots.permute(1, 0, 2)[index]  # [T, out, R]
    delta = torch.bmm(b, torch.bmm(a, x.unsqueeze(-1))).squeeze(-1)
    return delta * has_slot.unsqueeze(-1).to(delta.dtype)
