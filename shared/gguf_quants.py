"""GGUF's quantized blocks as int8 / int4 tensors with float32 scales, without dequantizing.

``--quantization auto`` keeps a GGUF file's Q8_0 and Q5_0 tensors as int8 and its Q4_0,
Q4_1 and Q4_K tensors as int4, in the one layout the worker's quantized products read
(``kernels/quant_linear.py``): blocks of 32 along a row, ``w = scale * q`` (int8) or
``w = scale * q + offset`` with q in 0..15 (int4). Each type maps onto it exactly:

- Q8_0:  scale = d                                   (q int8)
- Q5_0:  scale = d                                   (q = its 5-bit value - 16, int8)
- Q4_0:  scale = d,          offset = -8 d           (llama.cpp: d * (q - 8))
- Q4_1:  scale = d,          offset = m              (its block minimum)
- Q4_K:  scale = d * sc_j,   offset = -dmin * m_j    (per 32-value sub-block j of 256)

d, m, dmin are float16 and sc_j, m_j 6-bit integers, so every scale and offset is exact in
float32 and ``scale * q`` too: the values are the ones ``gguf.quants.dequantize`` returns.
Other types (Q6_K, Q5_1, Q5_K, ...) are dequantized to float at load: Q6_K's two scales per
32 values have no exact int8 form with one scale per block.

``dequantize`` turns the kept types into float32 through this form and the worker's C kernel
(``--quantization none``): the same values as gguf-py's, about 4x faster (gguf-py splits every
tensor into groups of rows in Python, 1.8 s of every start of the default model).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 32
INT8_TYPES = ("Q8_0", "Q5_0")
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")


@dataclass
class QuantizedTensor:
    """A ``[rows, cols]`` weight kept quantized: ``bits`` 8 (``data`` int8 ``[rows, cols]``)
    or 4 (``data`` uint8 ``[rows, cols / 2]``, two values a byte), ``scales`` and, for int4,
    ``offsets`` float32 ``[rows, cols / 32]``."""

    bits: int
    data: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        rows, width = self.data.shape
        return rows, width * 8 // self.bits

    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.data, self.scales, self.offsets) if t is not None)

    def to(self, device) -> "QuantizedTensor":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return QuantizedTensor(self.bits, move(self.data), move(self.scales), move(self.offsets))

    @staticmethod
    def cat(parts: list["QuantizedTensor"]) -> "QuantizedTensor":
        """The parts' rows one after another (q/k/v or gate/up fused into one matrix)."""
        bits = {p.bits for p in parts}
        if len(bits) != 1:
            raise ValueError(f"cannot fuse quantized tensors of {sorted(bits)} bits")
        offsets = None if parts[0].offsets is None else torch.cat([p.offsets for p in parts])
        return QuantizedTensor(parts[0].bits, torch.cat([p.data for p in parts]),
                               torch.cat([p.scales for p in parts]), offsets)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte ``start`` of every block, as float32 ``[..., 1]``."""
    return np.ascontiguousarray(blocks[..., start:start + 2]).view(np.float16).astype(np.float32)


def _pack_int4(q: np.ndarray) -> np.ndarray:
    """Values 0..15 ``[rows, cols]`` -> ``[rows, cols / 2]`` bytes, Q4_0's order per block."""
    rows, cols = q.shape
    halves = q.reshape(rows, cols // BLOCK, 2, 16)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(rows, cols // 2)


def quantized_from_gguf(data: np.ndarray, type_name: str, cols: int) -> QuantizedTensor | None:
    """A GGUF tensor's raw rows (uint8 ``[rows, bytes per row]``) of type ``type_name`` as a
    ``QuantizedTensor``; None for a type kept as float (F32, F16, other quantizations)."""
    rows = data.shape[0]
    if type_name not in INT8_TYPES + INT4_TYPES or cols % BLOCK:
        return None
    if type_name == "Q4_K":
        return _from_q4_k(data, rows, cols)
    if type_name == "Q5_0":
        return _from_q5_0(data, rows, cols)
    block_bytes = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[type_name]
    blocks = data.reshape(rows, cols // BLOCK, block_bytes)
    d = _f16(blocks, 0)[..., 0]
    if type_name == "Q8_0":
        q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows, cols)
        return QuantizedTensor(8, torch.from_numpy(q), torch.from_numpy(d))
    if type_name == "Q4_0":
        packed, offsets = blocks[..., 2:], -8 * d
    else:
        packed, offsets = blocks[..., 4:], _f16(blocks, 2)[..., 0]
    packed = np.ascontiguousarray(packed).reshape(rows, cols // 2)
    return QuantizedTensor(4, torch.from_numpy(packed), torch.from_numpy(d), torch.from_numpy(offsets))


def dequantize(data: np.ndarray, type_name: str, cols: int) -> torch.Tensor | None:
    """A GGUF tensor's raw rows as float32 ``[rows, cols]``, the values ``gguf.quants.dequantize``
    gives; None for a type this module does not keep (the caller asks gguf-py)."""
    kept = quantized_from_gguf(data, type_name, cols)
    if kept is None:
        return None
    from kernels.quant_linear import dequantize_int4_cpu, dequantize_int8_cpu

    if kept.bits == 8:
        return dequantize_int8_cpu(kept.data, kept.scales)
    return dequantize_int4_cpu(kept.data, kept.scales, kept.offsets)


def _from_q5_0(data: np.ndarray, rows: int, cols: int) -> QuantizedTensor:
    # Per block of 32: d (float16), 4 bytes of high bits (bit j: value j's), 16 bytes of low
    # nibbles (low nibble of byte j: value j, high nibble: value j + 16).
    blocks = data.reshape(rows, cols // BLOCK, 22)
    d = _f16(blocks, 0)[..., 0]
    high = np.ascontiguousarray(blocks[..., 2:6]).view(np.uint32)  # [rows, blocks, 1]
    high = ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [rows, blocks, 32]
    low = blocks[..., 6:, None] >> np.array([0, 4], dtype=np.uint8)  # [rows, blocks, 16, 2]
    low = (np.swapaxes(low, -1, -2) & 15).reshape(rows, cols // BLOCK, 32)
    q = ((low | (high << 4)).astype(np.int16) - 16).astype(np.int8).reshape(rows, cols)
    return QuantizedTensor(8, torch.from_numpy(q), torch.from_numpy(np.ascontiguousarray(d)))


def _from_q4_k(data: np.ndarray, rows: int, cols: int) -> QuantizedTensor | None:
    from gguf.quants import Q4_K

    if cols % 256:
        return None
    super_blocks = data.reshape(rows, cols // 256, 144)
    d, dmin = _f16(super_blocks, 0), _f16(super_blocks, 2)
    sc, mins = Q4_K.get_scale_min(super_blocks[..., 4:16].reshape(-1, 12))
    scales = (d * sc.reshape(rows, -1, 8).astype(np.float32)).reshape(rows, cols // BLOCK)
    offsets = -(dmin * mins.reshape(rows, -1, 8).astype(np.float32)).reshape(rows, cols // BLOCK)
    # Per 64 values: 32 bytes, low nibbles the first 32 values and high nibbles the next 32.
    qs = super_blocks[..., 16:].reshape(rows, cols // 64, 1, 32)
    q = ((qs >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 15).reshape(rows, cols)
    return QuantizedTensor(4, torch.from_numpy(_pack_int4(q)), torch.from_numpy(np.ascontiguousarray(scales)),
                           torch.from_numpy(np.ascontiguousarray(offsets)))


# llama_ftype ("general.file_type") of a file whose matrices are all of one type.
_FILE_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 7}


def requantize_gguf(src, dst, type_name: str) -> None:
    """Write ``dst``: the GGUF file ``src`` with every quantized matrix dequantized and
    quantized again as ``type_name`` (Q8_0, Q4_0 or Q4_1; gguf's own quantizers); metadata and
    float tensors as they are. For tests and accuracy figures (an int8 model from the
    shipped 4-bit file)."""
    import gguf

    from shared.model_config import gguf_value, open_gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    reader = open_gguf(src)
    writer = gguf.GGUFWriter(str(dst), gguf_value(reader, "general.architecture"))
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue
        value = _FILE_TYPES[type_name] if field.name == "general.file_type" else field.contents()
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, value_type, sub_type=sub_type)
    for t in reader.tensors:
        if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
            continue
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        writer.add_tensor(t.name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
