"""Reading a GGUF file's header: its metadata, and its tensors' names, types, shapes and
memory-mapped data.

gguf-py's ``GGUFReader`` keeps a numpy view of every part of every value: about a million
views for the default model's 49,152-token vocabulary and its merges, which cost every
service 1-1.5 s of CPU at each start, even read through a plain ndarray view of its memory
map (two thirds of the tokenizer's start-up). This reader decodes the values straight into
Python objects with ``struct`` and maps the tensors' bytes with numpy: 0.22 s of CPU for the
default model where gguf-py took 3.4 s (AVX2 machine, side by side, a test run beside them).
Its fields and tensors carry the names that gguf-py's do (``fields[key].contents()``,
``.types``; ``tensors[i].name``, ``.tensor_type``, ``.shape`` innermost first, ``.data``);
tests/shared/test_gguf_reader.py compares the two.

Two differences from gguf-py: an array of arrays is given as nested lists (gguf-py flattens
it), and an empty array's ``types`` name its element type (gguf-py's end at ``ARRAY``).
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

SUPPORTED_VERSIONS = (2, 3)

# struct's format character for each scalar type (with a byte-order prefix, no padding).
_STRUCT_CODES = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f", GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d", GGUFValueType.BOOL: "?",
}
# The element type of a tensor stored unquantized; every other type is read as bytes.
_PLAIN_TENSOR_DTYPES = {
    GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32, GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GGUFField:
    """One metadata key: its value as a Python scalar, string or list."""

    name: str
    types: list[GGUFValueType]  # [type], or [ARRAY, element type(s)]
    value: Any

    def contents(self) -> Any:
        return self.value


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # uint64, innermost dimension first (ggml's order)
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray  # read-only view of the mapping: typed values, or rows of quantized blocks' bytes


class GGUFFile:
    """The header of the GGUF file at ``path``, parsed at once; tensor data stay mapped."""

    def __init__(self, path: str | os.PathLike) -> None:
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.fields: dict[str, GGUFField] = {}
        self.tensors: list[GGUFTensor] = []
        self._offset = 0
        if self._map[:4] != struct.pack("<I", GGUF_MAGIC):
            raise ValueError("GGUF magic invalid")
        (version,) = struct.unpack_from("<I", self._map, 4)
        # A file written on a big-endian host reads as version << 16 here.
        self.byte_order = "<" if version & 0xFFFF else ">"
        self._offset = 4
        version = self._scalar(GGUFValueType.UINT32)
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(f"GGUF version {version} is not supported (supported: {SUPPORTED_VERSIONS})")
        self._add_field("GGUF.version", [GGUFValueType.UINT32], version)
        tensor_count = self._scalar(GGUFValueType.UINT64)
        kv_count = self._scalar(GGUFValueType.UINT64)
        self._add_field("GGUF.tensor_count", [GGUFValueType.UINT64], tensor_count)
        self._add_field("GGUF.kv_count", [GGUFValueType.UINT64], kv_count)
        for _ in range(kv_count):
            key = self._string()
            value_type = GGUFValueType(self._scalar(GGUFValueType.UINT32))
            types, value = self._value(value_type)
            self._add_field(key, types, value)
        infos = [self._tensor_info() for _ in range(tensor_count)]
        self.alignment = self._alignment()
        self.data_offset = -(-self._offset // self.alignment) * self.alignment
        self._add_tensors(infos)

    # ------------------------------------------------------------------ metadata

    def _add_field(self, name: str, types: list[GGUFValueType], value: Any) -> None:
        if name in self.fields:
            raise KeyError(f"GGUF key {name!r} appears twice")
        self.fields[name] = GGUFField(name, types, value)

    def _scalar(self, value_type: GGUFValueType) -> Any:
        code = self.byte_order + _STRUCT_CODES[value_type]
        (value,) = struct.unpack_from(code, self._map, self._offset)
        self._offset += struct.calcsize(code)
        return value

    def _string(self) -> str:
        length = self._scalar(GGUFValueType.UINT64)
        start, self._offset = self._offset, self._offset + length
        if self._offset > len(self._map):
            raise ValueError(f"GGUF string at byte {start} runs past the end of the file")
        return str(self._map[start:self._offset], "utf-8")

    def _value(self, value_type: GGUFValueType) -> tuple[list[GGUFValueType], Any]:
        if value_type == GGUFValueType.STRING:
            return [value_type], self._string()
        if value_type in _STRUCT_CODES:
            return [value_type], self._scalar(value_type)
        if value_type != GGUFValueType.ARRAY:
            raise ValueError(f"GGUF value type {value_type!r} is not known")
        element_type = GGUFValueType(self._scalar(GGUFValueType.UINT32))
        count = self._scalar(GGUFValueType.UINT64)
        if element_type in _STRUCT_CODES:
            code = self.byte_order + _STRUCT_CODES[element_type]
            values = np.frombuffer(self._map, np.dtype(code), count, self._offset)
            self._offset += values.nbytes
            return [value_type, element_type], values.tolist()
        if element_type == GGUFValueType.STRING:
            return [value_type, element_type], [self._string() for _ in range(count)]
        items = [self._value(element_type) for _ in range(count)]
        inner_types = items[0][0] if items else [element_type]
        return [value_type, *inner_types], [value for _, value in items]

    def _alignment(self) -> int:
        field = self.fields.get("general.alignment")
        if field is None:
            return GGUF_DEFAULT_ALIGNMENT
        if field.types != [GGUFValueType.UINT32]:
            raise ValueError("GGUF general.alignment must be a UINT32")
        if field.value <= 0 or field.value & (field.value - 1):
            raise ValueError(f"GGUF general.alignment must be a power of two, got {field.value}")
        return field.value

    # ------------------------------------------------------------------ tensors

    def _tensor_info(self) -> tuple[str, list[int], int, int]:
        name = self._string()
        n_dims = self._scalar(GGUFValueType.UINT32)
        dims = [self._scalar(GGUFValueType.UINT64) for _ in range(n_dims)]
        raw_type = self._scalar(GGUFValueType.UINT32)
        offset = self._scalar(GGUFValueType.UINT64)
        return name, dims, raw_type, offset

    def _add_tensors(self, infos: list[tuple[str, list[int], int, int]]) -> None:
        names = set()
        for name, dims, raw_type, offset in infos:
            if name in names:
                raise ValueError(f"GGUF tensor {name!r} appears twice")
            names.add(name)
            tensor_type = GGMLQuantizationType(raw_type)
            n_elements = math.prod(dims)
            block_size, type_size = GGML_QUANT_SIZES[tensor_type]
            n_bytes = n_elements * type_size // block_size
            shape = tuple(reversed(dims))  # outermost first, as numpy has it
            item = _PLAIN_TENSOR_DTYPES.get(tensor_type)
            if item is None:
                item, count, shape = np.uint8, n_bytes, quant_shape_to_byte_shape(shape, tensor_type)
            else:
                count = n_elements
            dtype = np.dtype(item).newbyteorder(self.byte_order)
            data_offset = self.data_offset + offset
            data = np.frombuffer(self._map, dtype, count, data_offset).reshape(shape)
            self.tensors.append(GGUFTensor(name, tensor_type, np.array(dims, dtype=np.uint64), n_elements,
                                           n_bytes, data_offset, data))
