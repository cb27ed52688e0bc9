"""GGUF LoRA files (as llama.cpp's convert_lora_to_gguf.py writes them) read into the same
fused layout as the PEFT folder they were made from, and the errors for what cannot be served."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from services.worker.lora.adapter import load_lora_adapter
from shared.lora import check_lora_adapter
from shared.lora_shapes import LoRAAdapterError
from shared.model_config import default_model_path, load_model_config
from tests.lora_reference import make_peft_adapter, write_gguf_lora
from tests.worker.test_lora_adapter import ALL_TARGETS, assert_refused, tiny_config, tiny_hf  # noqa: F401 (fixtures)


@pytest.fixture(scope="module")
def peft_folder(tiny_hf, tmp_path_factory):
    return make_peft_adapter(tiny_hf, tmp_path_factory.mktemp("peft") / "a", rank=4, alpha=12,
                             targets=ALL_TARGETS, seed=5)


def gguf_of(folder, file, config, **kwargs):
    return write_gguf_lora(folder, file, num_heads=config.num_attention_heads,
                           num_kv_heads=config.num_key_value_heads, **kwargs)


def assert_same_weights(got, want, atol=0.0):
    assert len(got.weights) == len(want.weights)
    for got_layer, want_layer in zip(got.weights, want.weights):
        assert set(got_layer) == set(want_layer)
        for projection, (a, b) in want_layer.items():
            torch.testing.assert_close(got_layer[projection][0], a, rtol=0, atol=atol)
            torch.testing.assert_close(got_layer[projection][1], b, rtol=0, atol=atol)


def test_f32_gguf_equals_its_peft_folder(tiny_config, peft_folder, tmp_path):
    """Same rank, scaling (alpha / r) and weights, bit for bit: the q/k permutation undone."""
    file = gguf_of(peft_folder, tmp_path / "a.gguf", tiny_config)
    assert check_lora_adapter(file, tiny_config, 8) == 4
    got = load_lora_adapter("a", file, tiny_config, max_rank=8)
    want = load_lora_adapter("a", peft_folder, tiny_config, max_rank=8)
    assert (got.rank, got.scaling) == (want.rank, want.scaling) == (4, 3.0)
    assert_same_weights(got, want)


def test_q_and_k_rows_really_are_permuted(tiny_config, peft_folder, tmp_path):
    """The same tensors unpermuted (as written for qwen2) but labelled "llama" give other q
    rows and the same gate/up: the equality above is no identity meeting an identity."""
    plain = gguf_of(peft_folder, tmp_path / "plain.gguf", tiny_config, architecture="qwen2")
    reader = gguf.GGUFReader(plain)
    writer = gguf.GGUFWriter(str(tmp_path / "mislabelled.gguf"), "llama")
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, 12.0)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data))
    write_all(writer)
    got = load_lora_adapter("m", tmp_path / "mislabelled.gguf", tiny_config, max_rank=8)
    want = load_lora_adapter("a", peft_folder, tiny_config, max_rank=8)
    q_rows = tiny_config.num_attention_heads * tiny_config.head_dim
    assert not torch.equal(got.weights[0]["qkv"][1][:q_rows], want.weights[0]["qkv"][1][:q_rows])
    torch.testing.assert_close(got.weights[0]["gate_up"][1], want.weights[0]["gate_up"][1], rtol=0, atol=0)


@pytest.mark.parametrize("tensor_type, atol", [("F16", 2e-3), ("BF16", 2e-2), ("Q8_0", 2e-2)])
def test_16_bit_and_q8_0_files(tiny_config, peft_folder, tmp_path, tensor_type, atol):
    file = gguf_of(peft_folder, tmp_path / "a.gguf", tiny_config, tensor_type=tensor_type)
    types = {t.tensor_type.name for t in gguf.GGUFReader(file).tensors}
    # Q8_0: B's rows (rank 4) are shorter than a block, so B is F16 as the converter writes it.
    assert types == ({"Q8_0", "F16"} if tensor_type == "Q8_0" else {tensor_type})
    got = load_lora_adapter("a", file, tiny_config, max_rank=8)
    assert_same_weights(got, load_lora_adapter("a", peft_folder, tiny_config, max_rank=8), atol=atol)


def test_no_alpha_means_scale_one(tiny_config, peft_folder, tmp_path):
    """llama.cpp: alpha 0 (or absent) scales by 1, not alpha / r."""
    file = gguf_of(peft_folder, tmp_path / "a.gguf", tiny_config, alpha=0.0)
    assert load_lora_adapter("a", file, tiny_config, max_rank=8).scaling == 1.0


def write_all(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_raw(file, tensors: dict, *, architecture="llama", general_type="adapter", adapter_type="lora",
              strings=None):
    """A GGUF file with exactly these metadata and float32 tensors."""
    writer = gguf.GGUFWriter(str(file), architecture)
    if general_type is not None:
        writer.add_string(gguf.Keys.General.TYPE, general_type)
    writer.add_string(gguf.Keys.Adapter.TYPE, adapter_type)
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, 8.0)
    for key, value in (strings or {}).items():
        writer.add_string(key, value)
    for name, value in tensors.items():
        writer.add_tensor(name, value)
    write_all(writer)
    return file


def test_errors_name_what_is_wrong(tiny_config, peft_folder, tmp_path):
    smollm_config = load_model_config(default_model_path())
    assert_refused(default_model_path(), smollm_config, 16,
                   "is not a LoRA adapter: general.type is 'model', not 'adapter'")
    file = gguf_of(peft_folder, tmp_path / "a.gguf", tiny_config)
    assert_refused(file, tiny_config, 2, "LoRA rank 4 is greater than max_lora_rank 2")
    assert_refused(file, smollm_config, 16, r"has A \(4, 128\) and B \(64, 4\); this base model needs A \(4, 1536\)")
    qwen = gguf_of(peft_folder, tmp_path / "q.gguf", tiny_config, architecture="qwen2")
    assert_refused(qwen, tiny_config, 16, "is for architecture 'qwen2'; the base model is 'llama'")
    (tmp_path / "junk.bin").write_bytes(b"not a gguf file")
    assert_refused(tmp_path / "junk.bin", tiny_config, 16, "is not a GGUF file")
    (tmp_path / "cut.gguf").write_bytes(file.read_bytes()[:200])
    assert_refused(tmp_path / "cut.gguf", tiny_config, 16, "cannot read GGUF file")
    with pytest.raises(LoRAAdapterError, match="is not a directory"):
        check_lora_adapter(tmp_path / "missing", tiny_config, 16)


def test_metadata_and_tensor_errors(tiny_config, tmp_path):
    hidden = tiny_config.hidden_size
    q_rows = tiny_config.num_attention_heads * tiny_config.head_dim
    q = {"blk.0.attn_q.weight.lora_a": np.ones((2, hidden), np.float32),
         "blk.0.attn_q.weight.lora_b": np.ones((q_rows, 2), np.float32)}
    cases = [
        (dict(tensors=q, general_type=None), "general.type is None"),
        (dict(tensors=q, adapter_type="control_vector"), "has adapter.type 'control_vector', not 'lora'"),
        (dict(tensors=q, strings={gguf.Keys.Adapter.ALORA_INVOCATION_TOKENS: "x"}), r"aLoRA\) adapters"),
        (dict(tensors={**q, "blk.0.attn_norm.weight": np.ones(hidden, np.float32)}), "norm weights"),
        (dict(tensors={**q, "output.weight.lora_a": np.ones((2, hidden), np.float32)}), "not in a decoder layer"),
        (dict(tensors={**q, "blk.0.attn_q.bias.lora_a": np.ones((2, hidden), np.float32)}),
         "not a lora_a / lora_b tensor"),
        (dict(tensors={"blk.0.attn_qkv.weight.lora_a": q["blk.0.attn_q.weight.lora_a"]}),
         "'attn_qkv' is not supported"),
        (dict(tensors={"blk.9.attn_q.weight.lora_a": q["blk.0.attn_q.weight.lora_a"]}),
         "the base model has 2 layers"),
        (dict(tensors={"blk.0.attn_q.weight.lora_a": q["blk.0.attn_q.weight.lora_a"]}), "lacks lora_A or lora_B"),
        (dict(tensors={**q, "blk.0.attn_v.weight.lora_a": np.ones((3, hidden), np.float32),
                       "blk.0.attn_v.weight.lora_b": np.ones((32, 3), np.float32)}), r"different ranks \[2, 3\]"),
        (dict(tensors={}), "has no weights"),
    ]
    for i, (spec, match) in enumerate(cases):
        assert_refused(write_raw(tmp_path / f"{i}.gguf", **spec), tiny_config, 16, match)


def test_unsupported_tensor_type(tiny_config, peft_folder, tmp_path):
    reader = gguf.GGUFReader(gguf_of(peft_folder, tmp_path / "a.gguf", tiny_config))
    writer = gguf.GGUFWriter(str(tmp_path / "q4.gguf"), "llama")
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    for t in reader.tensors:
        data = np.array(t.data)
        if t.name.endswith("lora_a"):
            writer.add_tensor(t.name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q4_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q4_0)
        else:
            writer.add_tensor(t.name, data)
    write_all(writer)
    assert_refused(tmp_path / "q4.gguf", tiny_config, 16, "is Q4_0; supported: F32, F16, BF16, Q8_0")
