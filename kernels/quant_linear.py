"""Weight-only quantized matrix products: ``x @ w.T`` with ``w`` kept as int8 or int4 blocks.

A weight ``[N, K]`` is quantized in blocks of 32 along K (GGUF's layout; ``K % 32 == 0``):

- int8 (GGUF Q8_0): ``q`` int8 ``[N, K]``, ``scales`` float32 ``[N, K/32]``;
  ``w[n, k] = scales[n, k // 32] * q[n, k]``.
- int4 (GGUF Q4_0 / Q4_1 / Q4_K): ``packed`` uint8 ``[N, K/2]``, ``scales`` and ``offsets``
  float32 ``[N, K/32]``; in block b, byte ``packed[n, 16b + i]`` holds element ``32b + i`` in
  its low nibble and ``32b + 16 + i`` in its high nibble (Q4_0 / Q4_1's own order), and
  ``w = scales * q + offsets`` with q in 0..15 (an asymmetric block's min is its offset).

``dequantize_int8_ref`` / ``dequantize_int4_ref`` are the PyTorch references (the values
``gguf.quants.dequantize`` gives, bit for bit: ``scale * q`` is exact in float32). The
products: ``*_linear_cpu`` through ``kernels/cpu/quant_linear.c`` (float32 activations, the
weight dequantized a few rows at a time into L1; for prompt-sized row counts the weight is
dequantized whole and handed to the BLAS, see docs/BENCHMARKS.md);
``*_linear_triton`` on CUDA, dequantizing tiles inside the kernel. Both compute in float32
and return ``x``'s dtype.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from kernels.cpu_build import bind
from kernels.triton_import import tl, triton

BLOCK = 32
# From this many rows on (prompt chunks), dequantizing the whole weight and running the
# BLAS's GEMM is as fast as the fused kernel, and faster beyond: the dequantization is paid
# once per product (scripts/bench_quant.py --kernels; docs/BENCHMARKS.md).
CPU_DEQUANT_GEMM_MIN_ROWS = 128

_P, _I64, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


@functools.cache
def _cpu_kernel(symbol: str):
    argtypes = {
        "int4_linear": [_P, _I64, _I, _I, _P, _P, _P, _I, _P, _I64, _I],
        "int8_linear": [_P, _I64, _I, _I, _P, _P, _I, _P, _I64, _I],
        "int4_dequantize": [_P, _P, _P, _I, _I, _P, _I],
        "int8_dequantize": [_P, _P, _I, _I, _P, _I],
    }[symbol]
    return bind("quant_linear", symbol, argtypes, ctypes.c_int if symbol.endswith("linear") else None)


# --------------------------------------------------------------------------- references


def dequantize_int8_ref(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    return (q.view(n, k // BLOCK, BLOCK).float() * scales.unsqueeze(-1)).view(n, k)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K/2]`` -> the 4-bit values 0..15 as uint8 ``[N, K]`` in element order."""
    n, half = packed.shape
    blocks = packed.view(n, half // 16, 16)
    return torch.stack((blocks & 15, blocks >> 4), dim=2).view(n, 2 * half)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """The inverse of ``unpack_int4``: values 0..15 ``[N, K]`` -> uint8 ``[N, K/2]``."""
    n, k = q.shape
    halves = q.to(torch.uint8).view(n, k // BLOCK, 2, 16)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2)


def dequantize_int4_ref(packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    n, k = packed.shape[0], packed.shape[1] * 2
    q = unpack_int4(packed).view(n, k // BLOCK, BLOCK).float()
    return (q * scales.unsqueeze(-1) + offsets.unsqueeze(-1)).view(n, k)


def int8_linear_ref(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return F.linear(x.float(), dequantize_int8_ref(q, scales)).to(x.dtype)


def int4_linear_ref(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return F.linear(x.float(), dequantize_int4_ref(packed, scales, offsets)).to(x.dtype)


# --------------------------------------------------------------------------- CPU


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as float32 rows with unit column stride (what the C kernel reads)."""
    x = x.float()
    return x if x.stride(-1) == 1 else x.contiguous()


def dequantize_int8_cpu(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    kernel = _cpu_kernel("int8_dequantize")
    if kernel is None:
        return dequantize_int8_ref(q, scales)
    n, k = q.shape
    out = torch.empty(n, k)
    kernel(q.data_ptr(), scales.data_ptr(), n, k, out.data_ptr(), torch.get_num_threads())
    return out


def dequantize_int4_cpu(packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    kernel = _cpu_kernel("int4_dequantize")
    if kernel is None:
        return dequantize_int4_ref(packed, scales, offsets)
    n, k = packed.shape[0], packed.shape[1] * 2
    out = torch.empty(n, k)
    kernel(packed.data_ptr(), scales.data_ptr(), offsets.data_ptr(), n, k, out.data_ptr(), torch.get_num_threads())
    return out


def int8_linear_cpu(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor,
                    gemm_min_rows: int | None = CPU_DEQUANT_GEMM_MIN_ROWS) -> torch.Tensor:
    """``x [M, K] @ dequantize(q, scales).T`` -> ``[M, N]`` in x's dtype; from ``gemm_min_rows``
    rows on (None: never) through the dequantized weight's GEMM."""
    kernel = _cpu_kernel("int8_linear")
    rows = _rows(x)
    if kernel is None or (gemm_min_rows is not None and rows.shape[0] >= gemm_min_rows):
        return F.linear(rows, dequantize_int8_cpu(q, scales)).to(x.dtype)
    (n, k), m = q.shape, rows.shape[0]
    y = torch.empty(m, n)
    if kernel(rows.data_ptr(), rows.stride(0), m, k, q.data_ptr(), scales.data_ptr(), n, y.data_ptr(), n,
              torch.get_num_threads()):
        raise MemoryError("int8_linear: no memory for a thread's row buffer")
    return y.to(x.dtype)


def int4_linear_cpu(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
                    gemm_min_rows: int | None = CPU_DEQUANT_GEMM_MIN_ROWS) -> torch.Tensor:
    """``x [M, K] @ dequantize(packed, scales, offsets).T`` -> ``[M, N]`` in x's dtype; from
    ``gemm_min_rows`` rows on (None: never) through the dequantized weight's GEMM."""
    kernel = _cpu_kernel("int4_linear")
    rows = _rows(x)
    if kernel is None or (gemm_min_rows is not None and rows.shape[0] >= gemm_min_rows):
        return F.linear(rows, dequantize_int4_cpu(packed, scales, offsets)).to(x.dtype)
    n, k, m = packed.shape[0], packed.shape[1] * 2, rows.shape[0]
    y = torch.empty(m, n)
    if kernel(rows.data_ptr(), rows.stride(0), m, k, packed.data_ptr(), scales.data_ptr(), offsets.data_ptr(), n,
              y.data_ptr(), n, torch.get_num_threads()):
        raise MemoryError("int4_linear: no memory for a thread's row buffer")
    return y.to(x.dtype)


# --------------------------------------------------------------------------- CUDA


@triton.jit
def _quant_linear_kernel(x_ptr, data_ptr, scales_ptr, offsets_ptr, y_ptr, M, N, K, x_stride, y_stride,
                         BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of y: per block of 32 along K, the weight tile is
    dequantized in registers as two [16, BLOCK_N] halves (the nibble halves for int4)."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    r16 = tl.arange(0, 16)
    m_ok, n_ok = rm < M, rn < N
    num_blocks = K // 32
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for b in range(0, num_blocks):
        x_row = x_ptr + rm[:, None] * x_stride + b * 32 + r16[None, :]
        x_lo = tl.load(x_row, mask=m_ok[:, None], other=0.0).to(tl.float32)
        x_hi = tl.load(x_row + 16, mask=m_ok[:, None], other=0.0).to(tl.float32)
        scale = tl.load(scales_ptr + rn * num_blocks + b, mask=n_ok, other=0.0)[None, :]
        if BITS == 4:
            offset = tl.load(offsets_ptr + rn * num_blocks + b, mask=n_ok, other=0.0)[None, :]
            packed = tl.load(data_ptr + rn[None, :] * (K // 2) + b * 16 + r16[:, None], mask=n_ok[None, :], other=0)
            w_lo = (packed & 15).to(tl.float32) * scale + offset
            w_hi = (packed >> 4).to(tl.float32) * scale + offset
        else:
            q_col = data_ptr + rn[None, :] * K + b * 32 + r16[:, None]
            w_lo = tl.load(q_col, mask=n_ok[None, :], other=0).to(tl.float32) * scale
            w_hi = tl.load(q_col + 16, mask=n_ok[None, :], other=0).to(tl.float32) * scale
        acc += tl.dot(x_lo, w_lo, input_precision="ieee")
        acc += tl.dot(x_hi, w_hi, input_precision="ieee")
    tl.store(y_ptr + rm[:, None] * y_stride + rn[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])


def _quant_linear_triton(x: torch.Tensor, bits: int, data: torch.Tensor, scales: torch.Tensor,
                         offsets: torch.Tensor | None, n: int, k: int) -> torch.Tensor:
    rows = x if x.stride(-1) == 1 else x.contiguous()
    m = rows.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=torch.float32)
    block_m, block_n = 16, 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _quant_linear_kernel[grid](rows, data, scales, scales if offsets is None else offsets, y, m, n, k,
                               rows.stride(0), y.stride(0), BITS=bits, BLOCK_M=block_m, BLOCK_N=block_n)
    return y.to(x.dtype)


def int8_linear_triton(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return _quant_linear_triton(x, 8, q, scales, None, q.shape[0], q.shape[1])


def int4_linear_triton(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                       offsets: torch.Tensor) -> torch.Tensor:
    return _quant_linear_triton(x, 4, packed, scales, offsets, packed.shape[0], packed.shape[1] * 2)
