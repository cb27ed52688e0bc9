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
``kernels/quant_linear.py`` does and return ``x``'s dtype: the C kernel reads float32 and
bfloat16 rows as they are and writes its result in their dtype (bfloat16 rounded from the
float32 sums as ``.to`` rounds), so a bfloat16 model's products need no float32 copies.

Per call the kernel gathers each 16-column tile of the weight into the layout ``vpdpbusd``
reads. ``repack_tiles`` does that once instead (AVX-512 VNNI and AVX2 builds):
``WeightTiles`` holds the same values as the row layout, tile by tile, and
``tiled_linear_cpu`` multiplies by it with no gather (the same arithmetic, so the same
result bit for bit). Where every scale (and offset) is a float16 value, as a GGUF file's
are, the tiles keep them as float16: as many bytes as the GGUF blocks (17% fewer for int4,
6% for int8 than float32 scales), which is what a one-row product's time goes by (it reads
the whole weight once, at the memory's speed).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kernels.cpu_build import bind, kernel_binding, library_isa

BLOCK = 32
TILE_N = 16  # output columns per tile (the C kernel's)
_P, _I64, _I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


@kernel_binding
def _kernel(symbol: str):
    argtypes = {
        "int4_linear_i8": [_P, _I64, _I, _I, _I, _P, _P, _P, _I, _P, _I64, _I, _I],
        "int8_linear_i8": [_P, _I64, _I, _I, _I, _P, _P, _I, _P, _I64, _I, _I],
        "quantize_activations": [_P, _I64, _I, _I, _P, _P, _P, _I],
        "linear_i8_tiled": [_P, _I64, _I, _I, _I, _P, _I, _I, _I, _P, _I64, _I, _I],
        "tiled_block_bytes": [_I, _I],
        "int8_products_use_vnni": [],
    }[symbol]
    return bind("int8_activation_linear", symbol, argtypes, None if symbol == "quantize_activations" else ctypes.c_int)


@kernel_binding
def available() -> bool:
    """Whether the C kernel was built for a vector instruction set it has a path for (AVX2
    at least; without, the functions below run the slow references)."""
    return library_isa("int8_activation_linear") not in (None, "generic")


@kernel_binding
def tiles_available() -> bool:
    """Whether the C kernel reads repacked tiles (its AVX-512 VNNI and AVX2 builds)."""
    return available() and _kernel("tiled_block_bytes")(4, 4) > 0


@kernel_binding
def half_scales_available() -> bool:
    """Whether the C kernel reads tiles with float16 scales (its AVX-512 build, and its AVX2
    build where the CPU has F16C)."""
    return tiles_available() and _kernel("tiled_block_bytes")(4, 2) > 0


@kernel_binding
def vnni_available() -> bool:
    """Whether the C kernel's products use AVX512_VNNI (else AVX2's vpmaddubsw, or none)."""
    return available() and _kernel("int8_products_use_vnni")() == 1


@dataclass
class WeightTiles:
    """A quantized weight ``[n, K]`` repacked for ``linear_i8_tiled``: ``tiles`` uint8
    ``[ceil(n / 16), K / 32, block bytes]``, per tile of 16 columns and per block the codes'
    dwords as vectors of 16 lanes (lane j: column j's), then the 16 scales (and for int4 the
    16 offsets) as float32, or float16 where ``scale_bytes`` is 2; the last tile repeats
    column n - 1 where n is not a multiple of 16. int4 (``bits`` 4): the 4 packed dwords,
    nibbles as in the row layout (384 bytes a block, 320 with float16 scales); int8: the 8
    dwords of signed codes (576 bytes, 544)."""

    tiles: torch.Tensor
    n: int
    bits: int
    scale_bytes: int = 4

    @property
    def shape(self) -> tuple[int, int]:
        return self.n, self.tiles.shape[1] * BLOCK

    def nbytes(self) -> int:
        return self.tiles.nbytes


def _dwords(bits: int) -> int:
    """Code dwords per block of 32 values: int4's 16 bytes, int8's 32."""
    return 4 if bits == 4 else 8


def _float16_exact(t: torch.Tensor) -> bool:
    return torch.equal(t.float().half().float(), t.float())


def repack_tiles(data: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None = None, *,
                 scale_bytes: int | None = None) -> WeightTiles:
    """A weight in ``kernels/quant_linear.py``'s row layout (int4 when ``offsets`` is given,
    else int8) as tiles: what the kernel's per-call gather builds, int4 nibbles still packed
    and int8 codes still signed. ``scale_bytes``: 2 keeps the scales (and offsets) as float16,
    4 as float32; by default 2 where each of them is a float16 value (so nothing changes) and
    the kernel reads float16 scales, else 4."""
    n, nb = scales.shape
    bits = 8 if offsets is None else 4
    dwords = _dwords(bits)
    floats = [t for t in (scales, offsets) if t is not None]
    if scale_bytes is None:
        scale_bytes = 2 if half_scales_available() and all(_float16_exact(t) for t in floats) else 4
    if scale_bytes not in (2, 4):
        raise ValueError(f"scale_bytes must be 2 or 4, got {scale_bytes}")
    float_dtype = torch.float16 if scale_bytes == 2 else torch.float32
    pad = -n % TILE_N
    last = lambda t: torch.cat([t, t[-1:].expand(pad, *t.shape[1:])]) if pad else t  # noqa: E731
    tiles = n // TILE_N + (pad > 0)
    # [tile, column, block, dword, byte] -> [tile, block, dword, column, byte]
    codes = (last(data).view(torch.uint8).view(tiles, TILE_N, nb, dwords, 4).permute(0, 2, 3, 1, 4)
             .reshape(tiles, nb, dwords * TILE_N * 4))
    floats = [last(t.to(float_dtype)).view(tiles, TILE_N, nb).transpose(1, 2).contiguous().view(torch.uint8)
              for t in floats]
    return WeightTiles(torch.cat([codes, *floats], dim=-1).contiguous(), n, bits, scale_bytes)


def unpack_tiles(weight: WeightTiles, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """``repack_tiles``'s inverse for ``rows`` (default all): (data, scales) for int8, (data,
    scales, offsets) for int4, in the row layout."""
    tiles, nb = weight.tiles.shape[:2]
    dwords = _dwords(weight.bits)
    code_bytes = dwords * TILE_N * 4
    if rows is None:
        rows = torch.arange(weight.n)
    tile, lane = rows // TILE_N, rows % TILE_N
    codes = weight.tiles[..., :code_bytes].view(tiles, nb, dwords, TILE_N, 4)[tile, :, :, lane]
    data = codes.reshape(len(rows), nb * dwords * 4)
    # Views of the whole tensor, indexed: only the rows' bytes are copied (the embedding's
    # lookups call this every step).
    width = weight.scale_bytes * TILE_N
    float_dtype = torch.float16 if weight.scale_bytes == 2 else torch.float32
    floats = [weight.tiles[..., at:at + width].view(float_dtype)[tile, :, lane].float()
              for at in range(code_bytes, weight.tiles.shape[-1], width)]
    return (data.view(torch.int8) if weight.bits == 8 else data, *floats)


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


def tiled_linear_ref(x: torch.Tensor, weight: WeightTiles) -> torch.Tensor:
    parts = unpack_tiles(weight)
    return int4_linear_ref(x, *parts) if weight.bits == 4 else int8_linear_ref(x, *parts)


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


# The kernel's result types (y_type): float32, bfloat16, bfloat16 widened to float32.
_Y_FLOAT32, _Y_BFLOAT16, _Y_BFLOAT16_AS_FLOAT32 = 0, 1, 2


def _run(symbol: str, x: torch.Tensor, n: int, *weight: torch.Tensor | int, widened: bool = False) -> torch.Tensor:
    """The kernel on ``x``'s rows as they are where it reads them (float32 or bfloat16 rows of
    unit stride), its result in ``x``'s dtype (float32 or bfloat16: rounded once from the same
    float32 sums, as ``.to`` rounds), or with ``widened`` that value as float32
    (``.to(x.dtype).float()``, written so at once)."""
    bf16 = x.dtype == torch.bfloat16
    rows = x if (bf16 or x.dtype == torch.float32) and x.stride(-1) == 1 else _rows(x)
    m, k = rows.shape
    y_type = (_Y_BFLOAT16_AS_FLOAT32 if widened else _Y_BFLOAT16) if bf16 else _Y_FLOAT32
    y = torch.empty(m, n, dtype=torch.bfloat16 if y_type == _Y_BFLOAT16 else torch.float32)
    args = [t.data_ptr() if isinstance(t, torch.Tensor) else t for t in weight]
    status = _kernel(symbol)(rows.data_ptr(), rows.stride(0), int(rows.dtype == torch.bfloat16), m, k, *args, n,
                             y.data_ptr(), n, y_type, torch.get_num_threads())
    if status == -2:
        raise ValueError(f"{symbol}: this build of the kernel does not read these tiles (float16 scales need F16C)")
    if status:
        raise MemoryError(f"{symbol}: no memory for the quantized activations or a thread's tile")
    if bf16 or x.dtype == torch.float32:
        return y
    return y.to(x.dtype).float() if widened else y.to(x.dtype)


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


def tiled_linear_cpu(x: torch.Tensor, weight: WeightTiles, *, widened: bool = False) -> torch.Tensor:
    """``x [M, K]`` (int8 per block) times the repacked weight, transposed -> ``[M, n]`` in
    ``x``'s dtype; ``widened``: that result as float32 (``.to(x.dtype).float()``, what the
    LM head's logits are), written so at once."""
    if not tiles_available():
        y = tiled_linear_ref(x, weight)
        return y.float() if widened else y
    return _run("linear_i8_tiled", x, weight.n, weight.tiles, weight.bits, weight.scale_bytes, widened=widened)
