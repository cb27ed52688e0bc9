"""Batch-invariant dense products on CPU: ``x @ W.T`` with a row's result independent of
the other rows in the product.

oneDNN's products (``services/worker/linear.py``'s prepacked ones, and ``F.linear``)
choose their K blocking by the row count: a row multiplied among 3 others can come out
with other last bits than alone (seen with K = 1536 in bfloat16 and float32 on the
benchmark CPU), which is enough to change a greedy token. ``kernels/cpu/dense_linear.c``
computes every output as one chain of multiply-adds over K in order, on one thread,
whatever the row count (threads split the columns): the ``--batch-invariant`` worker's
products of weights kept in bfloat16 or float32 (under tensor parallelism, or a
checkpoint that is not GGUF-quantized).

``repack`` lays a weight ``[N, K]`` out once in the kernel's tiles of 16 columns (as many
values, the last tile padded); ``dense_linear_cpu`` multiplies by it. bfloat16 tiles hold
pairs of K (vdpbf16ps's operand, with AVX512_BF16; other builds widen to float32), so K
must be even. ``dense_linear_ref`` is the PyTorch reference (float64).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.cpu_build import bind, kernel_binding

TILE_N = 16  # output columns per tile (the C kernel's)
_P, _I64, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


@kernel_binding
def _kernel(symbol: str):
    argtypes = {
        "dense_linear_bf16": [_P, _I64, _I, _I, _P, _I, _P, _I64, _I, _I],
        "dense_linear_f32": [_P, _I64, _I, _I, _P, _I, _P, _I64, _I],
        "dense_linear_uses_dpbf16": [],
    }[symbol]
    return bind("dense_linear", symbol, argtypes, ctypes.c_int if symbol == "dense_linear_uses_dpbf16" else None)


@dataclass
class DenseTiles:
    """A weight ``[n, k]`` repacked for the kernel: ``tiles`` ``[ceil(n / 16), k // 2, 16, 2]``
    bfloat16 (pairs of K per column) or ``[ceil(n / 16), k, 16]`` float32; the last tile
    repeats column n - 1 where n is not a multiple of 16."""

    tiles: torch.Tensor
    n: int
    k: int

    @property
    def dtype(self) -> torch.dtype:
        return self.tiles.dtype

    def nbytes(self) -> int:
        return self.tiles.nbytes


def available(dtype: torch.dtype, k: int | None = None) -> bool:
    """Whether the kernel takes weights of ``dtype`` (and reduction length ``k``) on this machine."""
    if dtype not in (torch.bfloat16, torch.float32) or (dtype == torch.bfloat16 and k is not None and k % 2):
        return False
    return _kernel("dense_linear_bf16" if dtype == torch.bfloat16 else "dense_linear_f32") is not None


def repack(weight: torch.Tensor) -> DenseTiles:
    n, k = weight.shape
    pad = -n % TILE_N
    w = weight.detach()
    if pad:
        w = torch.cat([w, w[-1:].expand(pad, k)])
    tiles = w.view(-1, TILE_N, k)
    if w.dtype == torch.bfloat16:
        tiles = tiles.view(-1, TILE_N, k // 2, 2).permute(0, 2, 1, 3)
    else:
        tiles = tiles.permute(0, 2, 1)
    return DenseTiles(tiles.contiguous(), n, k)


def dense_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    return y.to(x.dtype)


def dense_linear_cpu(x: torch.Tensor, weight: DenseTiles, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ W.T (+ bias)`` -> ``[M, n]`` in x's dtype (which must be the weight's).
    The bias is added to the rounded product, as oneDNN's bf16 products do it too."""
    if x.dtype != weight.dtype:
        raise TypeError(f"dense_linear_cpu: {x.dtype} rows times a {weight.dtype} weight")
    rows = x if x.stride(-1) == 1 else x.contiguous()
    m = rows.shape[0]
    y = torch.empty(m, weight.n, dtype=x.dtype)
    if m:
        if x.dtype == torch.bfloat16:
            _kernel("dense_linear_bf16")(rows.data_ptr(), rows.stride(0), m, weight.k, weight.tiles.data_ptr(),
                                         weight.n, y.data_ptr(), y.stride(0), 0, torch.get_num_threads())
        else:
            _kernel("dense_linear_f32")(rows.data_ptr(), rows.stride(0), m, weight.k, weight.tiles.data_ptr(),
                                        weight.n, y.data_ptr(), y.stride(0), torch.get_num_threads())
    return y if bias is None else y.add_(bias)


def uses_dpbf16() -> bool:
    """Whether the bf16 products use AVX512_BF16's vdpbf16ps (else float32 multiply-adds)."""
    return bool(_kernel("dense_linear_uses_dpbf16") and _kernel("dense_linear_uses_dpbf16")())
