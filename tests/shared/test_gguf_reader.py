"""GGUFFile reads a GGUF file's metadata and tensors as gguf-py's GGUFReader does: the default
model, and a file with every value type, a custom alignment and quantized and float
tensors, in either byte order; a broken file is refused with a clear error."""

import gc
import struct

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFEndian, GGUFReader, GGUFWriter
from gguf.quants import quantize

from shared.gguf_reader import GGUFFile


def assert_same_as_gguf_py(path):
    ours, theirs = GGUFFile(path), GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        mine = ours.fields[name]
        assert (mine.name, mine.types, mine.contents()) == (name, field.types, field.contents()), name
    assert (ours.data_offset, ours.alignment) == (theirs.data_offset, theirs.alignment)
    assert [(t.name, t.tensor_type, t.shape.tolist(), t.n_elements, t.n_bytes, t.data_offset) for t in ours.tensors] \
        == [(t.name, t.tensor_type, t.shape.tolist(), t.n_elements, t.n_bytes, t.data_offset) for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.data.shape == b.data.shape and a.data.dtype == b.data.dtype, a.name
        assert np.array_equal(a.data, b.data), a.name
    return ours


def test_the_default_model_reads_as_gguf_py_reads_it(smollm_path):
    reader = assert_same_as_gguf_py(smollm_path)
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == 49152


def write_every_kind(path, endianess=GGUFEndian.LITTLE):
    writer = GGUFWriter(str(path), "llama", endianess=endianess)
    writer.add_custom_alignment(64)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 1 / 3)
    writer.add_bool("t.bool", True)
    writer.add_string("t.string", "héllo, 世界")
    writer.add_string("t.empty_string", "")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.bools", [True, False, True])
    writer.add_array("t.strings", ["a", "", "ü", "<|im_end|>"])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 4)).astype(np.float16))
    writer.add_tensor("i32", np.arange(7, dtype=np.int32))
    q8 = quantize(rng.standard_normal((4, 64)).astype(np.float32), GGMLQuantizationType.Q8_0)
    writer.add_tensor("q8", q8, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("endianess", [GGUFEndian.LITTLE, GGUFEndian.BIG])
def test_every_value_type_alignment_and_tensor_kind_read_as_gguf_py_reads_them(tmp_path, endianess):
    reader = assert_same_as_gguf_py(write_every_kind(tmp_path / "every.gguf", endianess))
    assert reader.byte_order == ("<" if endianess == GGUFEndian.LITTLE else ">")
    assert reader.alignment == 64 and reader.data_offset % 64 == 0
    value = {name: f.contents() for name, f in reader.fields.items()}
    assert value["t.u64"] == 2**63 + 5 and value["t.string"] == "héllo, 世界" and value["t.bool"] is True
    assert value["t.strings"] == ["a", "", "ü", "<|im_end|>"] and value["t.bools"] == [True, False, True]
    assert value["t.f32"] == pytest.approx(0.1) and value["t.i64"] == -(2**62)
    q8 = next(t for t in reader.tensors if t.name == "q8")
    assert q8.tensor_type == GGMLQuantizationType.Q8_0 and q8.shape.tolist() == [64, 4] and q8.data.shape == (4, 68)


def test_tensor_data_outlive_the_reader(smollm_path):
    tensor = GGUFFile(smollm_path).tensors[0]
    gc.collect()
    assert type(tensor.data) is np.ndarray and not tensor.data.flags.writeable
    assert np.array_equal(tensor.data, GGUFReader(smollm_path).tensors[0].data)


def test_broken_files_are_refused_with_what_is_wrong(tmp_path):
    good = write_every_kind(tmp_path / "good.gguf").read_bytes()
    cases = {
        "magic": (b"GGML" + good[4:], "magic"),
        "version": (good[:4] + struct.pack("<I", 9) + good[8:], "version 9"),
        "header cut": (good[:40], None),
        "string cut": (good[:good.index(b"t.strings") + 30], None),
        "data cut": (good[:-100], "buffer is smaller"),
    }
    for name, (data, message) in cases.items():
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(data)
        with pytest.raises((ValueError, struct.error)) as info:
            GGUFFile(path)
        assert message is None or message in str(info.value), (name, info.value)
