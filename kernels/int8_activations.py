"""Quantized-weight products with the activations quantized to int8 too (llama.cpp's way).

``kernels/quant_linear.py`` multiplies float activations by the exactly dequantized weight;
here each activation row is quantized per block of 32 along K, on the fly:

    d = max|x_block| / 127,   q = round(x / d) in -127..127 (half to even),   s = d * sum(q)

and a product block is integer arithmetic plus two float multiply-adds: with a weight block
``w = dw * u + ow`` (int4: u = q in 0..15, ow its offset; int8: u = q + 128, ow = -128 dw),

    sum_i x_i w_i  ~  sum_i d qa_i (dw u_i + ow) = d dw sum_i qa_i u_i + ow s.

The integer sums are exact (``kernels/cpu/int8_activation_linear.c``: AVX512_VNNI
``vpdpbusd``, or ``vpmaddubsw`` + ``vpmaddwd`` in the AVX2 build), so the kernel and
``int8_activation_linear_ref`` differ only in the float32 order of the per-block terms.
The activations' rounding is the approximation (about 0.4% of a block's largest value);
scripts/bench_quant.py measures what it does to greedy output and perplexity, and which
row counts it is faster for (docs/BENCHMARKS.md). Both functions take the weight as
``kernels/quant_linear.py`` does and return ``x``'s dtype.
"""

from __future__ import annotations

import ctypes

import torch

from kernels.cpu_build import bind, kernel_binding, library_isa

BLOCK = 32
_P, _I64, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


@kernel_binding
def _kernel(symbol: str):
    argtypes = {
        "int4_linear_i8": [_P, _I64, _I, _I, _P, _P, _P, _I, _P, _I64, _I],
        "int8_linear_i8": [_P, _I64, _I, _I, _P, _P, _I, _P, _I64, _I],
        "quantize_activations": [_P, _I64, _I, _I, _P, _P, _P, _I],
    }[symbol]
    return bind("int8_activation_linear", symbol, argtypes, None if symbol == "quantize_activations" else ctypes.c_int)


@kernel_binding
def available() -> bool:
    """Whether the C kernel was built for a vector instruction set it has a path for (AVX2
    at least; without, the functions below run the slow references)."""
    return library_isa("int8_activation_linear") not in (None, "generic")


# --------------------------------------------------------------------------- references


def quantize_activations_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (q int8 ``[M, K]``, d float32 ``[M, K/32]``, s = d * sum(q) float32),
    with the kernel's float32 operations in its order (so the same values bit for bit)."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // BLOCK, BLOCK)
    d = blocks.abs().amax(-1) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv.unsqueeze(-1))
    return q.to(torch.int8).view(m, k), d, d * q.sum(-1)


def _block_dot(qa: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per block, the exact integer dot products of ``qa [M, K]`` and ``u [N, K]``: ``[M, N, K/32]``
    (float64 holds them exactly: |sum| < 32 * 255 * 127)."""
    m, k = qa.shape
    n = u.shape[0]
    a = qa.double().view(m, k // BLOCK, BLOCK).transpose(0, 1)
    w = u.double().view(n, k // BLOCK, BLOCK).transpose(0, 1)
    return torch.bmm(a, w.transpose(1, 2)).permute(1, 2, 0)


def _ref(x: torch.Tensor, u: torch.Tensor, dw: torch.Tensor, ow: torch.Tensor) -> torch.Tensor:
    qa, d, s = quantize_activations_ref(x)
    dots = _block_dot(qa, u)
    y = (dots * (dw.double().unsqueeze(0) * d.double().unsqueeze(1))).sum(-1)
    y += s.double() @ ow.double().T
    return y.float().to(x.dtype)


def int4_linear_ref(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    from kernels.quant_linear import unpack_int4

    return _ref(x, unpack_int4(packed), scales, offsets)


def int8_linear_ref(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return _ref(x, q.short() + 128, scales, -128 * scales)


# --------------------------------------------------------------------------- CPU


def _rows(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    return x if x.stride(-1) == 1 else x.contiguous()


def quantize_activations_cpu(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The C kernel's quantization alone (what the products use), for tests."""
    rows = _rows(x)
    m, k = rows.shape
    q, d, s = torch.empty(m, k, dtype=torch.int8), torch.empty(m, k // BLOCK), torch.empty(m, k // BLOCK)
    _kernel("quantize_activations")(rows.data_ptr(), rows.stride(0), m, k, q.data_ptr(), d.data_ptr(), s.data_ptr(),
                                    torch.get_num_threads())
    return q, d, s


def _run(symbol: str, x: torch.Tensor, n: int, *weight: torch.Tensor) -> torch.Tensor:
    rows = _rows(x)
    m, k = rows.shape
    y = torch.empty(m, n)
    args = [t.data_ptr() for t in weight]
    if _kernel(symbol)(rows.data_ptr(), rows.stride(0), m, k, *args, n, y.data_ptr(), n, torch.get_num_threads()):
        raise MemoryError(f"{symbol}: no memory for the quantized activations or a thread's tile")
    return y.to(x.dtype)


def int4_linear_cpu(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` (int8 per block) times the int4 weight ``[N, K]``, transposed -> ``[M, N]``."""
    if not available():
        return int4_linear_ref(x, packed, scales, offsets)
    return _run("int4_linear_i8", x, packed.shape[0], packed, scales, offsets)


def int8_linear_cpu(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` (int8 per block) times the int8 weight ``[N, K]``, transposed -> ``[M, N]``."""
    if not available():
        return int8_linear_ref(x, q, scales)
    return _run("int8_linear_i8", x, q.shape[0], q, scales)
