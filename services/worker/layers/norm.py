"""RMSNorm as a layer: its weight, loaded by name, and the kernel call.

``offset``: Gemma's zero-centred norm, ``x_normed * (1 + w)``. The checkpoint holds ``w``
(as Hugging Face's model does); ``1 + w`` is computed once after loading, in float32 as
Hugging Face computes it on every call, so the products are the same.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import KernelOps

from .weights import weight_slot


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: KernelOps, name: str, offset: bool = False) -> None:
        super().__init__()
        self.eps, self.ops, self.name, self.offset = eps, ops, name, offset
        self.weight = nn.Parameter(torch.empty(size), requires_grad=False)

    def weight_slots(self):
        yield f"{self.name}.weight", weight_slot(self.weight.data, tuple(self.weight.shape))

    def after_loading(self) -> None:
        if self.offset:
            self.weight.data = 1.0 + self.weight.data.float()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``rms_norm(x)``; with ``residual``: ``(rms_norm(x + residual), x + residual)``."""
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.rms_norm(x, self.weight, self.eps, residual)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A decoder layer's first norm: ``(rms_norm(x + residual), x + residual)``, where a
        missing ``residual`` (the first layer's) is zero."""
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps), x
        return self.ops.rms_norm(x, self.weight, self.eps, residual)
