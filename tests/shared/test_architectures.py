"""The architecture table: every family it describes has a model class in the worker, and a
model or a config field we cannot honour is refused at start-up, named."""

from __future__ import annotations

import json

import pytest

from services.worker.models.registry import MODEL_CLASSES, model_class
from shared.architectures import ARCHITECTURES
from shared.config import ConfigError
from shared.kv_cache_groups import kv_cache_layout
from shared.model_config import load_model_config
from tests.tiny_models import TINY_CONFIGS, make_tiny_model


def test_every_architecture_has_a_model_class():
    assert set(MODEL_CLASSES) == set(ARCHITECTURES)
    assert set(TINY_CONFIGS) | {"llama"} == set(ARCHITECTURES)  # and a tiny model in the tests


def write_config(folder, **fields):
    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=100, max_position_embeddings=256)
    (folder / "config.json").write_text(json.dumps({**base, **fields}))
    return folder


@pytest.mark.parametrize("fields, named", [
    (dict(architectures=["GPT2LMHeadModel"]), "GPT2LMHeadModel"),
    (dict(architectures=["Gemma3ForCausalLM"], attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    (dict(architectures=["Gemma3ForCausalLM"], final_logit_softcapping=30.0), "final_logit_softcapping"),
    (dict(architectures=["Phi3ForCausalLM"], partial_rotary_factor=0.5), "partial_rotary_factor"),
    (dict(architectures=["LlamaForCausalLM"], hidden_act="gelu"), "hidden_act"),
    (dict(architectures=["LlamaForCausalLM"], mlp_bias=True), "mlp_bias"),
    (dict(architectures=["Qwen3MoeForCausalLM"], num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0]),
     "mlp_only_layers"),
    (dict(architectures=["Qwen3MoeForCausalLM"], num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2),
     "decoder_sparse_step"),
    (dict(architectures=["MistralForCausalLM"], layer_types=["sliding_attention", "full_attention"]),
     "sliding_window"),
])
def test_what_cannot_be_honoured_is_refused_by_name(tmp_path, fields, named):
    with pytest.raises(ConfigError, match=named):
        load_model_config(write_config(tmp_path, **fields))


def test_a_sliding_window_is_read_per_family(tmp_path):
    mistral = load_model_config(write_config(tmp_path, architectures=["MistralForCausalLM"], sliding_window=32))
    assert [mistral.layer_sliding_window(i) for i in range(2)] == [32, 32]
    # Qwen2 without use_sliding_window: the window is not used (as transformers).
    qwen = load_model_config(write_config(tmp_path, architectures=["Qwen2ForCausalLM"], sliding_window=32))
    assert qwen.layer_types is None
    qwen = load_model_config(write_config(tmp_path, architectures=["Qwen2ForCausalLM"], sliding_window=32,
                                          use_sliding_window=True, max_window_layers=1))
    assert [qwen.layer_sliding_window(i) for i in range(2)] == [None, 32]
    gemma = load_model_config(write_config(tmp_path, architectures=["Gemma3ForCausalLM"], num_hidden_layers=12,
                                           sliding_window=512))
    assert [i for i in range(12) if gemma.layer_sliding_window(i) is None] == [5, 11]  # every sixth layer global
    assert gemma.tie_word_embeddings and gemma.hidden_act == "gelu_pytorch_tanh" and gemma.rope_local_theta == 10000


def test_kv_cache_groups_are_of_equal_size_full_attention_first():
    layout = kv_cache_layout([64, 64, None, 64, 64, 64, 64, None])
    assert layout.group_size == 2
    assert [(g.sliding_window, g.layers) for g in layout.groups] == [
        (None, (2, 7)), (64, (0, 1)), (64, (3, 4)), (64, (5, 6))]
    assert [layout.tensor_of(layer) for layer in range(8)] == [0, 1, 0, 0, 1, 0, 1, 1]
    assert not kv_cache_layout([None] * 4).is_hybrid and kv_cache_layout([None, 8]).is_hybrid


def test_a_model_without_a_class_is_refused_at_start_up(tmp_path, monkeypatch):
    config = load_model_config(make_tiny_model("qwen3", tmp_path / "m"))
    monkeypatch.delitem(MODEL_CLASSES, "qwen3")
    with pytest.raises(ConfigError, match="qwen3"):
        model_class(config)


def test_lora_on_a_mixture_of_experts_is_refused(tmp_path):
    from services.worker.model_runner import ModelRunner
    from shared.config import CacheConfig, LoRAConfig, ModelRunConfig, SchedulerConfig

    folder = make_tiny_model("qwen3_moe", tmp_path / "moe")
    runner = ModelRunner(ModelRunConfig(model=str(folder), dtype="float32", quantization="none"),
                         CacheConfig(num_gpu_blocks=16), SchedulerConfig(max_num_seqs=2))
    with pytest.raises(ConfigError, match="enable_lora"):
        runner.use_lora(LoRAConfig(enable_lora=True))


def test_kv_offloading_tiers_with_sliding_windows_are_refused(tmp_path):
    from services.engine import Engine
    from shared.config import CacheConfig, KVOffloadConfig, ModelRunConfig, SchedulerConfig

    folder = make_tiny_model("mistral", tmp_path / "m")
    with pytest.raises(ConfigError, match="kv_offloading_size.*sliding-window"):
        Engine(ModelRunConfig(model=str(folder), dtype="float32", quantization="none"),
               CacheConfig(num_gpu_blocks=16), SchedulerConfig(max_num_seqs=2),
               kv_offload_config=KVOffloadConfig(kv_offloading_size=0.01))
