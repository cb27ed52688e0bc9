"""GGUF blocks kept as int8 / int4 (``shared.gguf_quants``): their dequantized values, and
``dequantize``'s, are ``gguf.quants.dequantize``'s bit for bit, for every kept type and for
the shipped model."""

import gguf
import numpy as np
import pytest
import torch

import shared.model_files
from kernels.quant_linear import dequantize_int4_ref, dequantize_int8_ref
from shared.gguf_quants import QuantizedTensor, dequantize, quantized_from_gguf, requantize_gguf
from shared.model_config import load_model_config
from shared.model_files import open_weights

ROWS, COLS = 6, 512


def dequantized(t: QuantizedTensor) -> torch.Tensor:
    return dequantize_int8_ref(t.data, t.scales) if t.bits == 8 else dequantize_int4_ref(t.data, t.scales, t.offsets)


def random_q4_k(rows: int, cols: int, rng) -> np.ndarray:
    """Random Q4_K super-blocks (any bytes are valid ones, but for finite float16 d and dmin)."""
    blocks = rng.integers(0, 256, size=(rows, cols // 256, 144), dtype=np.uint8)
    halves = rng.uniform(1e-3, 1e-2, size=(rows, cols // 256, 2)).astype(np.float16)
    blocks[..., :4] = halves.view(np.uint8).reshape(rows, cols // 256, 4)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q5_0", "Q4_0", "Q4_1", "Q4_K"])
def test_kept_blocks_dequantize_to_gguf_values(type_name):
    rng = np.random.default_rng(0)
    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name == "Q4_K":  # gguf has no Q4_K quantizer
        data = random_q4_k(ROWS, COLS, rng)
    else:
        data = gguf.quants.quantize(rng.standard_normal((ROWS, COLS)).astype(np.float32), qtype)
    kept = quantized_from_gguf(data, type_name, COLS)
    assert kept.bits == (8 if type_name in ("Q8_0", "Q5_0") else 4)
    assert kept.shape == (ROWS, COLS)
    expected = torch.from_numpy(gguf.quants.dequantize(data, qtype).reshape(ROWS, COLS))
    assert torch.equal(dequantized(kept), expected)
    assert torch.equal(dequantize(data, type_name, COLS), expected)


def test_other_types_are_not_kept():
    data = np.zeros((2, 64), dtype=np.float32)
    assert quantized_from_gguf(data.view(np.uint8), "F32", 64) is None
    assert quantized_from_gguf(np.zeros((2, 210), dtype=np.uint8), "Q6_K", 256) is None
    assert dequantize(np.zeros((2, 210), dtype=np.uint8), "Q6_K", 256) is None


def test_the_shipped_models_tensors_load_as_gguf_py_dequantizes_them(smollm_path, monkeypatch):
    with open_weights(smollm_path) as weights:
        names = weights.names()
        loaded = {name: weights.load(name) for name in names}
        monkeypatch.setattr(shared.model_files, "dequantize", lambda *args: None)  # gguf-py for every type
        for name in names:
            assert torch.equal(loaded[name], weights.load(name)), name
        name = "model.layers.3.self_attn.k_proj.weight"  # permuted rows, sliced either way
        assert torch.equal(weights.load_slice(name, 0, 16, 48), loaded[name][16:48])
        assert torch.equal(weights.load_slice(name, 1, 64, 128), loaded[name][:, 64:128])


def test_fused_parts_keep_their_rows():
    rng = np.random.default_rng(1)
    parts = [quantized_from_gguf(gguf.quants.quantize(rng.standard_normal((r, 64)).astype(np.float32),
                                                      gguf.GGMLQuantizationType.Q4_1), "Q4_1", 64) for r in (3, 2)]
    fused = QuantizedTensor.cat(parts)
    assert torch.equal(dequantized(fused), torch.cat([dequantized(p) for p in parts]))
    with pytest.raises(ValueError, match="bits"):
        QuantizedTensor.cat([parts[0], quantized_from_gguf(np.zeros((1, 68), np.uint8), "Q8_0", 64)])


@pytest.mark.parametrize("name", ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                                  "model.layers.5.self_attn.k_proj.weight", "model.layers.29.mlp.down_proj.weight"])
def test_the_shipped_models_matrices_kept_quantized_equal_the_dequantized_ones(smollm_path, name):
    with open_weights(smollm_path) as weights:
        kept = weights.load_quantized(name)  # q / k: llama.cpp's row permutation undone
        assert torch.equal(dequantized(kept), weights.load(name))
        assert weights.load_quantized("model.norm.weight") is None


def test_requantized_file_has_the_same_config_and_close_weights(smollm_path, tmp_path):
    path = tmp_path / "q8.gguf"
    requantize_gguf(smollm_path, path, "Q8_0")
    assert load_model_config(path) == load_model_config(smollm_path)
    name = "model.layers.3.mlp.up_proj.weight"
    with open_weights(path) as q8, open_weights(smollm_path) as q4:
        assert q8.load_quantized(name).bits == 8
        a, b = q8.load(name), q4.load(name)
        # Q8_0's error is at most half a step, 1/254 of a block's largest magnitude.
        assert (a - b).abs().max() <= b.abs().max() / 254 * 1.01
        assert torch.equal(q8.load("model.norm.weight"), q4.load("model.norm.weight"))
