"""PEFT adapter folders read into our fused layout, and the errors for what cannot be served."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.worker.lora.adapter import load_lora_adapter
from shared.lora import check_lora_adapter, lora_scaling
from shared.lora_shapes import LoRAAdapterError
from tests.lora_reference import make_peft_adapter

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def tiny_hf(tiny_llama):
    return tiny_llama[1]


@pytest.fixture(scope="module")
def tiny_config(tiny_llama):
    return tiny_llama[0].model_config


@pytest.mark.parametrize("use_rslora", [False, True])
def test_fused_layout_gives_each_modules_delta(tiny_hf, tiny_config, tmp_path, use_rslora):
    folder = make_peft_adapter(tiny_hf, tmp_path / "a", rank=4, alpha=12, targets=ALL_TARGETS,
                               use_rslora=use_rslora, seed=3)
    adapter = load_lora_adapter("a", folder, tiny_config, max_rank=8)
    assert adapter.rank == 4 and adapter.scaling == pytest.approx(12 / 2 if use_rslora else 12 / 4)
    raw = load_file(str(folder / "adapter_model.safetensors"))
    x = torch.randn(5, tiny_config.hidden_size)
    a, b = adapter.weights[1]["qkv"]
    fused = (x @ a.t()) @ b.t()
    q_size = tiny_config.num_attention_heads * tiny_config.head_dim
    kv_size = tiny_config.num_key_value_heads * tiny_config.head_dim
    starts = {"q_proj": 0, "k_proj": q_size, "v_proj": q_size + kv_size}
    for module, start in starts.items():
        prefix = f"base_model.model.model.layers.1.self_attn.{module}"
        want = adapter.scaling * (x @ raw[f"{prefix}.lora_A.weight"].t()) @ raw[f"{prefix}.lora_B.weight"].t()
        torch.testing.assert_close(fused[:, start : start + want.shape[1]], want, rtol=1e-5, atol=1e-5)


def test_absent_modules_are_absent(tiny_hf, tiny_config, tmp_path):
    folder = make_peft_adapter(tiny_hf, tmp_path / "qv", rank=2, alpha=4, targets=["q_proj", "v_proj"])
    adapter = load_lora_adapter("qv", folder, tiny_config, max_rank=4)
    assert all(set(layer) == {"qkv"} for layer in adapter.weights)
    a, b = adapter.weights[0]["qkv"]
    q_size = tiny_config.num_attention_heads * tiny_config.head_dim
    kv_size = tiny_config.num_key_value_heads * tiny_config.head_dim
    assert not b[q_size : q_size + kv_size].any()  # k rows: no delta
    assert lora_scaling({"r": 2, "lora_alpha": 4}) == 2


def assert_refused(path, model_config, max_rank, match):
    """Both the gateway's header-only check and the workers' read refuse it, with ``match``."""
    with pytest.raises(LoRAAdapterError, match=match):
        check_lora_adapter(path, model_config, max_rank)
    with pytest.raises(LoRAAdapterError, match=match):
        load_lora_adapter("x", path, model_config, max_rank)


def test_errors_name_what_is_wrong(tiny_hf, tiny_config, smollm_worker, tmp_path):
    assert_refused(tmp_path / "missing", tiny_config, 16, "is not a directory")
    (tmp_path / "empty").mkdir()
    assert_refused(tmp_path / "empty", tiny_config, 16, "has no adapter_config.json")
    folder = make_peft_adapter(tiny_hf, tmp_path / "r8", rank=8, alpha=8, targets=["q_proj"])
    assert check_lora_adapter(folder, tiny_config, 8) == 8
    assert_refused(folder, tiny_config, 4, "LoRA rank 8 is greater than max_lora_rank 4")
    # Made for the tiny model, served on SmolLM2: the shapes do not fit.
    assert_refused(folder, smollm_worker.model_config, 16, r"this base model needs A \(8, 576\)")
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    assert_refused(folder, tiny_config, 16, "use_dora")
    (folder / "adapter_config.json").write_text(json.dumps(config))
    weights = load_file(str(folder / "adapter_model.safetensors"))
    weights["base_model.model.lm_head.lora_A.weight"] = torch.zeros(8, 64)
    save_file(weights, str(folder / "adapter_model.safetensors"))
    assert_refused(folder, tiny_config, 16, "not in a decoder layer")
    (folder / "adapter_model.safetensors").write_bytes(b"junk")
    assert_refused(folder, tiny_config, 16, "cannot read")
