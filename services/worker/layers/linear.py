"""Weight matrices that load their own shard: column-parallel, row-parallel or replicated.

A ``LinearLayer`` holds this rank's ``[out, in]`` part of a matrix made of one or more
checkpoint tensors (``Part``): q/k/v stacked into one matrix, gate/up into another, or a
fused checkpoint tensor (Phi-3's ``qkv_proj``) cut back into its logical parts so that
each rank takes its heads of each. Column-parallel layers split the output rows across
ranks (each part's rows are this rank's range of that part); row-parallel layers split the
input columns and all-reduce their partial sums; replicated layers hold the whole matrix.
With one rank every part is its whole checkpoint tensor, so the matrix may stay quantized
(``keep_quantized``) or be laid out once for its products (``prepack``: oneDNN's prepacking,
or the batch-invariant kernel's tiles).

``proj`` is the product of the local matrix (what LoRA wraps: its delta joins the partial
sum before the all-reduce); calling the layer runs ``proj`` and, row-parallel, the
all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..linear import Linear, cpu_layout, plain_linear, quantized_linear
from ..parallel import TensorParallel
from .weights import Quantizable, weight_slot

COLUMN, ROW, REPLICATED = "column", "row", "replicated"


@dataclass(frozen=True)
class Part:
    """Rows ``[start, stop)`` (column-parallel; columns, row-parallel) of checkpoint tensor
    ``name`` (without ".weight"), whose size along that dimension is ``full``; ``offset``:
    where this logical part begins inside a fused checkpoint tensor."""

    name: str
    full: int
    start: int
    stop: int
    offset: int = 0

    @property
    def size(self) -> int:
        return self.stop - self.start

    @staticmethod
    def whole(name: str, size: int) -> "Part":
        return Part(name, size, 0, size)


def _coalesce(parts: list[Part]) -> list[Part]:
    """Consecutive parts reading adjacent ranges of one checkpoint tensor, as one part (a
    fused tensor at one rank is read whole)."""
    out: list[Part] = []
    for part in parts:
        last = out[-1] if out else None
        if last is not None and last.name == part.name and last.offset + last.stop == part.offset + part.start:
            out[-1] = Part(last.name, last.full, last.offset + last.start, part.offset + part.stop)
        else:
            out.append(Part(part.name, part.full, part.offset + part.start, part.offset + part.stop))
    return out


class LinearLayer(nn.Module, Quantizable):
    """``x @ W.T (+ b)`` over this rank's part of ``W``; see the module docstring.
    ``checkpoint_width``: the other dimension of every checkpoint tensor (the input size,
    column-parallel; the output size, row-parallel)."""

    def __init__(self, parts: list[Part], checkpoint_width: int, *, parallel: str, tp: TensorParallel,
                 bias: bool = False) -> None:
        super().__init__()
        if parallel == ROW and bias:
            raise ValueError("a row-parallel layer with a bias is not supported")
        self.parallel = parallel
        self.parts = _coalesce(parts)
        local = sum(part.size for part in self.parts)
        shape = (checkpoint_width, local) if parallel == ROW else (local, checkpoint_width)
        self.weight = nn.Parameter(torch.empty(shape), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(local), requires_grad=False) if bias else None
        self.checkpoint_width = checkpoint_width
        self.checkpoint_names = tuple(dict.fromkeys(f"{part.name}.weight" for part in self.parts))
        self.all_reduce = tp.all_reduce if parallel == ROW and tp.enabled else None
        self.proj: Linear = plain_linear(self, "weight", "bias" if bias else None)
        self.quantized = None  # the kept-quantized matrix; then ``weight`` is empty

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        return y if self.all_reduce is None else self.all_reduce(y)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0] if self.quantized is None else self.quantized.shape[0]

    def weight_slots(self):
        dim = 1 if self.parallel == ROW else 0
        at = 0
        for part in self.parts:
            rows = slice(at, at + part.size)
            target = self.weight.data[:, rows] if dim == 1 else self.weight.data[rows]
            full = (self.checkpoint_width, part.full) if dim == 1 else (part.full, self.checkpoint_width)
            yield f"{part.name}.weight", weight_slot(target, full, dim, part.start, part.stop)
            if self.bias is not None:
                yield f"{part.name}.bias", weight_slot(self.bias.data[rows], (part.full,), 0, part.start, part.stop)
            at += part.size

    def keep_quantized(self, tensor, batch_invariant: bool = False) -> None:
        device = self.weight.device
        self.quantized = cpu_layout(tensor.to(device))
        self.weight.data = torch.empty(0, dtype=self.weight.dtype, device=device)
        self.proj = quantized_linear(self.quantized, self.bias, batch_invariant)

    def prepack(self, pack) -> int:
        """Lay the float matrix out once with ``pack`` (``..linear.weight_packer``) and drop
        the checkpoint-layout copy; returns the bytes of the packed copy (0 when kept
        quantized)."""
        if self.quantized is not None:
            return 0
        self.proj = pack(self.weight, self.bias)
        nbytes = self.weight.nbytes
        self.weight.data = torch.empty(0, dtype=self.weight.dtype, device=self.weight.device)
        return nbytes

    def quantized_bytes(self) -> int:
        return 0 if self.quantized is None else self.quantized.nbytes()


def column_parallel(parts: list[Part], in_features: int, tp: TensorParallel, bias: bool = False) -> LinearLayer:
    return LinearLayer(parts, in_features, parallel=COLUMN, tp=tp, bias=bias)


def row_parallel(part: Part, out_features: int, tp: TensorParallel) -> LinearLayer:
    return LinearLayer([part], out_features, parallel=ROW, tp=tp)


def replicated(name: str, out_features: int, in_features: int, bias: bool = False) -> LinearLayer:
    return LinearLayer([Part.whole(name, out_features)], in_features, parallel=REPLICATED,
                       tp=TensorParallel.single(), bias=bias)
