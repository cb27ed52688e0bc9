"""The model's matrix products with a weight: plain ``F.linear``, or oneDNN prepacked on CPU.

``F.linear`` on CPU hands the weight to the BLAS in its checkpoint layout on every call;
oneDNN can reorder a weight once into the blocked layout its kernels read, after which
each product skips that work. On a 2-core AVX-512 machine that makes SmolLM2-135M's
products 1.3x to 4x faster (fp32 and bf16, batch 1 to 32; see docs/BENCHMARKS.md).
The reordered tensor is opaque (``torch._mkldnn`` layout): only ``_linear_pointwise`` reads it.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

Linear = Callable[[torch.Tensor], torch.Tensor]

# oneDNN picks its blocking for this many rows; any row count works afterwards.
_PACK_ROWS_HINT = 32


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether weights of this dtype on this device can be prepacked for oneDNN."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def plain_linear(module: nn.Module, weight: str, bias: str | None = None) -> Linear:
    """``x @ W.T (+ b)`` reading ``module.<weight>`` at call time (so loading and dtype
    changes after construction are seen)."""
    if bias is None:
        return lambda x: nn.functional.linear(x, getattr(module, weight))
    return lambda x: nn.functional.linear(x, getattr(module, weight), getattr(module, bias))


def prepacked_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
    """``x @ weight.T (+ bias)`` through oneDNN on a copy of ``weight`` reordered once."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_ROWS_HINT)
    bias = None if bias is None else bias.detach()

    def linear(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    return linear
