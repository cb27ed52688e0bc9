"""The model's matrix products with a weight: plain ``F.linear``, or oneDNN prepacked on CPU.

``F.linear`` on CPU hands the weight to the BLAS in its checkpoint layout on every call;
oneDNN can reorder a weight once into the blocked layout its kernels read, after which
each product skips that work. On a 2-core AVX-512 machine that makes SmolLM2-135M's
products 1.3x to 4x faster (fp32 and bf16, batch 1 to 32; see docs/BENCHMARKS.md).
The reordered tensor is opaque (``torch._mkldnn`` layout): only ``_linear_pointwise`` reads it.
``quantized_linear`` runs a weight kept as GGUF's int8 / int4 blocks (``--quantization auto``):
on CPU, products of few rows through ``kernels/quant_linear.py`` (the exactly dequantized
weight, float activations: bandwidth-bound, the fewest bytes win), products of more rows
through ``kernels/int8_activations.py`` (activations quantized to int8 per block, integer
dot products: compute-bound, VNNI wins); on CUDA, the Triton kernel. ``cpu_layout`` repacks
a weight once at load into the tiles the int8-activation kernel reads (its AVX-512 VNNI and
AVX2 builds): it is then kept only so, and every product of it, whatever its row count,
runs that kernel with no per-call gather (docs/BENCHMARKS.md). ``weight_packer`` picks how
float weight matrices are laid out once at load: oneDNN's prepacking, or with
``--batch-invariant`` the tiles of ``kernels/dense_linear.py``, whose products give a row
the same bits at any row count (oneDNN's do not: its K blocking follows the row count).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from kernels import dense_linear, int8_activations, quant_linear
from kernels.int8_activations import WeightTiles
from shared.gguf_quants import QuantizedTensor

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


def invariant_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
    """``x @ weight.T (+ bias)`` through the batch-invariant kernel on a copy of ``weight``
    repacked once (``kernels/dense_linear.py``)."""
    tiles = dense_linear.repack(weight)
    bias = None if bias is None else bias.detach()
    return lambda x: dense_linear.dense_linear_cpu(x, tiles, bias)


def weight_packer(device: torch.device, dtype: torch.dtype, cpu_prepack: bool,
                  batch_invariant: bool) -> Callable[..., Linear] | None:
    """How the model's float weight matrices are laid out once for their products, where
    ``cpu_prepack`` allows it (without, their products read the checkpoint layout,
    ``plain_linear``: None): ``invariant_linear`` (``batch_invariant``, CPU, where the
    kernel is built), else ``prepacked_linear`` (where oneDNN takes the dtype)."""
    if not cpu_prepack:
        return None
    if batch_invariant and device.type == "cpu" and dense_linear.available(dtype):
        return invariant_linear
    return prepacked_linear if can_prepack(device, dtype) else None


# CPU products of at least this many rows of a row-layout matrix quantize their activations
# to int8; fewer rows multiply the exact weight (scripts/bench_quant.py --kernels: the
# crossover on the benchmark CPU, docs/BENCHMARKS.md). Matrices repacked by cpu_layout (all,
# unless REPACK_TILES is cleared or the kernel has no vector build) take int8 activations at
# every row count. Read at each call: scripts/bench_quant.py and the tests set it high to
# measure the exact path alone.
INT8_ACTIVATIONS_MIN_ROWS = 4
# The same where the int8-activation kernel has no AVX512_VNNI (its AVX2 build): there the
# exact kernel's AVX2 build lost to it even at 1 row (142.6 against 23.4 ms per step's
# products, docs/BENCHMARKS.md, "An AVX2-only CPU, approximated").
INT8_ACTIVATIONS_MIN_ROWS_WITHOUT_VNNI = 1


def int8_activations_min_rows() -> int:
    """From how many rows a CPU product of a row-layout matrix takes int8 activations."""
    if int8_activations.vnni_available():
        return INT8_ACTIVATIONS_MIN_ROWS
    return INT8_ACTIVATIONS_MIN_ROWS_WITHOUT_VNNI


def _cpu_kernel(exact, int8_activated, batch_invariant: bool):
    """A row-layout matrix's CPU product: by row count (``INT8_ACTIVATIONS_MIN_ROWS``), or with
    ``batch_invariant`` one kernel whatever the row count (each computes every row alone, in
    one order): int8 activations where that kernel is built, else the exact fused kernel
    (never the whole-matrix GEMM its prompt-sized products take)."""
    if batch_invariant:
        return lambda x, *weight: (int8_activated(x, *weight) if int8_activations.available()
                                   else exact(x, *weight, gemm_min_rows=None))

    def product(x: torch.Tensor, *weight: torch.Tensor) -> torch.Tensor:
        few_rows = x.shape[0] < int8_activations_min_rows()
        kernel = exact if few_rows or not int8_activations.available() else int8_activated
        return kernel(x, *weight)

    return product


# Whether cpu_layout repacks weights into tiles (read at load: scripts/bench_quant.py and the
# tests clear it for a model whose products all can take the exact kernel).
REPACK_TILES = True


def cpu_layout(weight: QuantizedTensor) -> QuantizedTensor | WeightTiles:
    """``weight`` as its products read it: on CPU repacked into the int8-activation kernel's
    tiles where that kernel reads them (as many bytes; the row layout is not kept, so the
    exact kernel can no longer take it), else as it is."""
    if REPACK_TILES and weight.data.device.type == "cpu" and int8_activations.tiles_available():
        return int8_activations.repack_tiles(weight.data, weight.scales, weight.offsets)
    return weight


def quantized_linear(weight: QuantizedTensor | WeightTiles, bias: torch.Tensor | None = None,
                     batch_invariant: bool = False, widened: bool = False) -> Linear:
    """``x @ W.T (+ bias)`` with ``W`` kept quantized, on ``weight``'s device: the C kernels
    on CPU (repacked tiles: the int8-activation kernel at every row count; else by row
    count, see INT8_ACTIVATIONS_MIN_ROWS, or with ``batch_invariant`` one kernel for every
    row count), the Triton kernels on CUDA; the result in ``x``'s dtype, or with
    ``widened`` (no bias) that result as float32 (the LM head's logits: repacked tiles write
    it so at once)."""
    if widened:
        if bias is not None:
            raise ValueError("a widened product takes no bias")
        if isinstance(weight, WeightTiles):
            return lambda x: int8_activations.tiled_linear_cpu(x, weight, widened=True)
        product = quantized_linear(weight, batch_invariant=batch_invariant)
        return lambda x: product(x).float()
    if isinstance(weight, WeightTiles):
        kernel, args = int8_activations.tiled_linear_cpu, (weight,)
    elif weight.bits == 8:
        kernel = (_cpu_kernel(quant_linear.int8_linear_cpu, int8_activations.int8_linear_cpu, batch_invariant)
                  if weight.data.device.type == "cpu" else quant_linear.int8_linear_triton)
        args = (weight.data, weight.scales)
    else:
        kernel = (_cpu_kernel(quant_linear.int4_linear_cpu, int8_activations.int4_linear_cpu, batch_invariant)
                  if weight.data.device.type == "cpu" else quant_linear.int4_linear_triton)
        args = (weight.data, weight.scales, weight.offsets)
    if bias is None:
        return lambda x: kernel(x, *args)
    return lambda x: kernel(x, *args).add_(bias)


def dequantize(weight: QuantizedTensor) -> torch.Tensor:
    """The whole weight in float32 (its values as ``gguf.quants.dequantize`` gives them)."""
    if weight.bits == 8:
        return quant_linear.dequantize_int8_ref(weight.data, weight.scales)
    return quant_linear.dequantize_int4_ref(weight.data, weight.scales, weight.offsets)


def quantized_embedding(weight: QuantizedTensor | WeightTiles, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` (1-D) of a quantized embedding table, dequantized to ``dtype``."""
    if isinstance(weight, WeightTiles):
        return dequantize(QuantizedTensor(weight.bits, *int8_activations.unpack_tiles(weight, ids))).to(dtype)
    offsets = None if weight.offsets is None else weight.offsets[ids]
    return dequantize(QuantizedTensor(weight.bits, weight.data[ids], weight.scales[ids], offsets)).to(dtype)
