"""The model architectures we serve, and how each one's config and GGUF tensors are read.

One ``Architecture`` per family, keyed by our name for it. ``shared/model_config.py`` reads a
Hugging Face ``config.json`` or a GGUF header into a ``ModelConfig`` through the entry the
file names (``architectures[0]`` / ``general.architecture``); ``shared/model_files.py`` names a
GGUF file's tensors with the entry's table. The worker's model class for each name is in
``services/worker/models/registry.py`` (a test checks that every name here has one). An
architecture not listed here is refused at start-up with its name, and so is a config field
an entry cannot honour (``Architecture.hf_config`` raises, naming it).

Adding an architecture: an entry here (its HF class names, GGUF name, the config fields it
adds, the llama.cpp tensor names it adds), and a model file registered in the worker (see
docs/ARCHITECTURE.md, "Adding an architecture").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shared.config_error import ConfigError

# llama.cpp tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N."), for
# the dense Llama-shaped decoder every architecture starts from.
DENSE_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_QK_NORM_GGUF_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Mixture-of-experts tensors: the router, and each projection of every expert, which
# llama.cpp stacks into one 3-D tensor and Hugging Face keeps one tensor per expert (the
# "{e}" in a name: shared/model_files.py gives the stack as those per-expert tensors).
QWEN3_MOE_GGUF_LAYER_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
    "ffn_up_exps": "mlp.experts.{e}.up_proj",
    "ffn_down_exps": "mlp.experts.{e}.down_proj",
}
MIXTRAL_GGUF_LAYER_NAMES = {
    "ffn_gate_inp": "block_sparse_moe.gate",
    "ffn_gate_exps": "block_sparse_moe.experts.{e}.w1",
    "ffn_up_exps": "block_sparse_moe.experts.{e}.w3",
    "ffn_down_exps": "block_sparse_moe.experts.{e}.w2",
}

FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")


def _refuse_set(cfg: dict, *keys: str) -> None:
    """ConfigError naming the first of ``keys`` that ``cfg`` sets (not null, false or 0)."""
    for key in keys:
        if cfg.get(key):
            raise ConfigError(f"config field {key}={cfg[key]!r} is not supported")


def _hidden_act(cfg: dict, expected: str = "silu", key: str = "hidden_act") -> str:
    act = cfg.get(key) or expected
    if act != expected:
        raise ConfigError(f"config field {key}={act!r} is not supported (expected {expected!r})")
    return act


def _sliding_layer_types(cfg: dict, num_layers: int, *, all_layers_when_set: bool) -> dict:
    """``sliding_window`` and ``layer_types`` from config.json: the saved ``layer_types`` when
    there are some (transformers 5 writes them), else every layer sliding when a window is
    set (``all_layers_when_set``: Mistral, Phi-3) or Qwen2's ``use_sliding_window`` rule
    (layers from ``max_window_layers`` on)."""
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if types is None:
        if not window:
            return {}
        if all_layers_when_set:
            types = [SLIDING_ATTENTION] * num_layers
        elif cfg.get("use_sliding_window"):
            first = cfg.get("max_window_layers", num_layers)
            types = [SLIDING_ATTENTION if i >= first else FULL_ATTENTION for i in range(num_layers)]
        else:
            return {}
    types = tuple(types)
    if SLIDING_ATTENTION not in types:
        return {}
    if not window:
        raise ConfigError("config field layer_types names sliding_attention layers but sliding_window is not set")
    return {"sliding_window": int(window), "layer_types": types}


def _llama_hf(cfg: dict) -> dict:
    _refuse_set(cfg, "mlp_bias")
    _hidden_act(cfg)
    return {"attention_bias": bool(cfg.get("attention_bias", False))}


def _mistral_hf(cfg: dict) -> dict:
    _hidden_act(cfg)
    return _sliding_layer_types(cfg, cfg["num_hidden_layers"], all_layers_when_set=True)


def _qwen2_hf(cfg: dict) -> dict:
    _hidden_act(cfg)
    return {"attention_bias": True, **_sliding_layer_types(cfg, cfg["num_hidden_layers"], all_layers_when_set=False)}


def _qwen3_hf(cfg: dict) -> dict:
    _hidden_act(cfg)
    return {"attention_bias": bool(cfg.get("attention_bias", False)), "qk_norm": True,
            **_sliding_layer_types(cfg, cfg["num_hidden_layers"], all_layers_when_set=False)}


def _phi3_hf(cfg: dict) -> dict:
    _hidden_act(cfg)
    factor = cfg.get("partial_rotary_factor", 1.0)
    if factor not in (None, 1.0):
        raise ConfigError(f"config field partial_rotary_factor={factor!r} is not supported")
    return _sliding_layer_types(cfg, cfg["num_hidden_layers"], all_layers_when_set=True)


def _gemma3_hf(cfg: dict) -> dict:
    _refuse_set(cfg, "final_logit_softcapping", "attn_logit_softcapping", "use_bidirectional_attention")
    rope = cfg.get("rope_parameters") or {}
    local = rope.get(SLIDING_ATTENTION) or {}
    if local.get("rope_type", "default") != "default":
        raise ConfigError(f"config field rope_parameters.sliding_attention.rope_type={local['rope_type']!r} "
                          "is not supported")
    num_layers = cfg["num_hidden_layers"]
    pattern = cfg.get("sliding_window_pattern", 6)
    types = cfg.get("layer_types") or [
        SLIDING_ATTENTION if (i + 1) % pattern else FULL_ATTENTION for i in range(num_layers)]
    return {
        "hidden_act": _hidden_act(cfg, "gelu_pytorch_tanh", "hidden_activation"),
        "qk_norm": True,
        "attention_bias": bool(cfg.get("attention_bias", False)),
        "sliding_window": int(cfg.get("sliding_window") or 4096),
        "layer_types": tuple(types),
        "rope_local_theta": float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0))),
        "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar", 256)),
    }


def _gemma3_gguf(meta: Callable[..., Any], num_layers: int) -> dict:
    # As llama.cpp reads a gemma3 file: every sixth layer global, the local rope base 10000
    # (not in the file), the query scale from head_dim, but from hidden / heads for the 27B
    # model (its 62 layers).
    window = meta("attention.sliding_window", 4096)
    scalar = meta("embedding_length") // meta("attention.head_count") if num_layers == 62 else meta("attention.key_length")
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "qk_norm": True,
        "sliding_window": int(window),
        "layer_types": tuple(SLIDING_ATTENTION if (i + 1) % 6 else FULL_ATTENTION for i in range(num_layers)),
        "rope_local_theta": 10000.0,
        "query_pre_attn_scalar": float(scalar),
    }


def _moe_hf(cfg: dict, *, intermediate_key: str, norm_default: bool) -> dict:
    # transformers 5 writes num_local_experts for every MoE config; Qwen's own num_experts.
    return {
        "num_experts": int(cfg.get("num_experts") or cfg["num_local_experts"]),
        "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
        "moe_intermediate_size": int(cfg.get(intermediate_key) or cfg["intermediate_size"]),
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", norm_default)),
    }


def _qwen3_moe_hf(cfg: dict) -> dict:
    _refuse_set(cfg, "mlp_only_layers")
    if cfg.get("decoder_sparse_step", 1) != 1:
        raise ConfigError(f"config field decoder_sparse_step={cfg['decoder_sparse_step']!r} is not supported")
    return {**_qwen3_hf(cfg), **_moe_hf(cfg, intermediate_key="moe_intermediate_size", norm_default=False)}


def _mixtral_hf(cfg: dict) -> dict:
    # Mixtral always renormalises its top-k weights.
    return {**_mistral_hf(cfg), **_moe_hf(cfg, intermediate_key="intermediate_size", norm_default=True),
            "norm_topk_prob": True}


def _moe_gguf(meta: Callable[..., Any], num_layers: int, *, norm_topk_prob: bool) -> dict:
    return {
        "num_experts": int(meta("expert_count")),
        "num_experts_per_tok": int(meta("expert_used_count")),
        "moe_intermediate_size": int(meta("expert_feed_forward_length", meta("feed_forward_length"))),
        "norm_topk_prob": norm_topk_prob,
    }


def _llama_gguf(meta: Callable[..., Any], num_layers: int) -> dict:
    # llama.cpp writes Mixtral as "llama" with experts.
    if meta("expert_count", 0):
        return {"architecture": "mixtral", **_moe_gguf(meta, num_layers, norm_topk_prob=True)}
    return {}


def _no_extras(*_args) -> dict:
    return {}


@dataclass(frozen=True)
class Architecture:
    """One family: where its configs come from and how its GGUF tensors are named."""

    name: str
    hf_classes: tuple[str, ...]  # config.json ``architectures`` values
    gguf_name: str | None = None  # general.architecture (None: not read from GGUF)
    # ModelConfig fields beyond the shared ones, from config.json (raises ConfigError naming a
    # field it cannot honour) and from a GGUF header (``meta(key, default)`` reads
    # "<gguf_name>.<key>"; the second argument is the layer count).
    hf_config: Callable[[dict], dict] = _no_extras
    gguf_config: Callable[[Callable[..., Any], int], dict] = _no_extras
    # llama.cpp layer tensor names beyond (or replacing) DENSE_GGUF_LAYER_NAMES.
    gguf_layer_names: dict[str, str] = field(default_factory=dict)
    # llama.cpp's converter permuted the Q/K rows (its "llama" rotary is interleaved).
    gguf_permutes_qk: bool = False
    # llama.cpp stores the zero-centred norm weights w as 1 + w (Gemma).
    gguf_norms_offset: bool = False
    # config.json's tie_word_embeddings when it does not say (the HF config class's default).
    tie_word_embeddings_default: bool = False
    # config.json ``model_type`` values beyond our name, for a config without ``architectures``.
    hf_model_types: tuple[str, ...] = ()

    def gguf_tensor_names(self) -> dict[str, str]:
        return {**DENSE_GGUF_LAYER_NAMES, **self.gguf_layer_names}


ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("llama", ("LlamaForCausalLM",), "llama", _llama_hf, _llama_gguf, gguf_permutes_qk=True),
    Architecture("mistral", ("MistralForCausalLM",), None, _mistral_hf),
    Architecture("qwen2", ("Qwen2ForCausalLM",), "qwen2", _qwen2_hf, lambda meta, n: {"attention_bias": True}),
    Architecture("qwen3", ("Qwen3ForCausalLM",), "qwen3", _qwen3_hf, lambda meta, n: {"qk_norm": True},
                 gguf_layer_names=_QK_NORM_GGUF_NAMES),
    Architecture("phi3", ("Phi3ForCausalLM",), "phi3", _phi3_hf,
                 lambda meta, n: ({"sliding_window": int(meta("attention.sliding_window")),
                                   "layer_types": (SLIDING_ATTENTION,) * n}
                                  if meta("attention.sliding_window", 0) else {}),
                 gguf_layer_names={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}),
    Architecture("gemma3", ("Gemma3ForCausalLM",), "gemma3", _gemma3_hf, _gemma3_gguf,
                 gguf_layer_names={**_QK_NORM_GGUF_NAMES, "post_attention_norm": "post_attention_layernorm",
                                   "ffn_norm": "pre_feedforward_layernorm",
                                   "post_ffw_norm": "post_feedforward_layernorm"},
                 hf_model_types=("gemma3_text",), gguf_norms_offset=True, tie_word_embeddings_default=True),
    Architecture("qwen3_moe", ("Qwen3MoeForCausalLM",), "qwen3moe", _qwen3_moe_hf,
                 lambda meta, n: {"qk_norm": True, **_moe_gguf(meta, n, norm_topk_prob=True)},
                 gguf_layer_names={**_QK_NORM_GGUF_NAMES, **QWEN3_MOE_GGUF_LAYER_NAMES}),
    Architecture("mixtral", ("MixtralForCausalLM",), None, _mixtral_hf,
                 gguf_layer_names=MIXTRAL_GGUF_LAYER_NAMES, gguf_permutes_qk=True),
)}
HF_CLASSES = {cls: arch.name for arch in ARCHITECTURES.values() for cls in arch.hf_classes}
HF_MODEL_TYPES = {arch.name: arch.name for arch in ARCHITECTURES.values()} | {
    t: arch.name for arch in ARCHITECTURES.values() for t in arch.hf_model_types}
GGUF_NAMES = {arch.gguf_name: arch.name for arch in ARCHITECTURES.values() if arch.gguf_name}


def architecture(name: str) -> Architecture:
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise ConfigError(f"architecture {name!r} is not supported (supported: {sorted(ARCHITECTURES)})") from None
