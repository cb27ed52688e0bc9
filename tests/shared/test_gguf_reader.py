"""PlainViewGGUFReader parses a GGUF file exactly as gguf-py's GGUFReader does."""

import gc

import numpy as np
from gguf import GGUFReader

from shared.gguf_reader import PlainViewGGUFReader


def test_fields_and_tensors_match_gguf_py(smollm_path):
    ours, theirs = PlainViewGGUFReader(smollm_path), GGUFReader(smollm_path)
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        mine = ours.fields[name]
        assert (mine.offset, mine.types, mine.data) == (field.offset, field.types, field.data), name
        assert len(mine.parts) == len(field.parts) and all(
            np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(mine.parts, field.parts)
        ), name
    assert ours.data_offset == theirs.data_offset and ours.alignment == theirs.alignment
    assert [(t.name, t.tensor_type, list(t.shape), t.data_offset) for t in ours.tensors] == [
        (t.name, t.tensor_type, list(t.shape), t.data_offset) for t in theirs.tensors
    ]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name


def test_reads_through_a_plain_view_that_keeps_the_mapping(smollm_path):
    reader = PlainViewGGUFReader(smollm_path)
    tensor = reader.tensors[0]
    assert type(reader.data) is np.ndarray and type(tensor.data) is np.ndarray
    expected = tensor.data.copy()
    del reader
    gc.collect()
    # The view's base chain still holds the memmap, so the bytes stay readable.
    assert np.array_equal(tensor.data, expected)
