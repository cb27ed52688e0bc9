"""A tiny Hugging Face folder (``tests/tiny_models.py``) written as a GGUF file with gguf-py,
named and laid out as llama.cpp's convert_hf_to_gguf.py writes it: float32 tensors under
llama.cpp's names (Phi-3's q/k/v and gate/up fused as ``attn_qkv`` / ``ffn_up``, Gemma's
norm weights stored as ``1 + w``, MoE experts stacked into 3-D ``*_exps`` tensors), the
hyper-parameters under ``<arch>.*`` and the byte-level BPE tokenizer under ``tokenizer.ggml.*``.

Only what transformers' GGUF loader reads too is written (no Phi-3 sliding window: it would
be ours alone), so the same file loads on both sides for a greedy comparison.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from shared.model_files import SafetensorsWeights

_GGUF_ARCH = {"qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "gemma3": "gemma3", "qwen3_moe": "qwen3moe"}
_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}
_GEMMA_NAMES = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def _gguf_name(arch: str, name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if name in top:
        return top[name]
    m = _LAYER.match(name)
    module = m.group(2)
    table = {**_NAMES, **(_GEMMA_NAMES if arch == "gemma3" else {})}
    return f"blk.{m.group(1)}.{table[module]}.{m.group(3)}"


def write_tiny_gguf(folder: str | Path, out: str | Path, arch: str) -> Path:
    import gguf

    folder, out = Path(folder), Path(out)
    cfg = json.loads((folder / "config.json").read_text())
    gguf_arch = _GGUF_ARCH[arch]
    writer = gguf.GGUFWriter(str(out), gguf_arch)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    writer.add_rope_freq_base(float((rope.get("full_attention") or rope).get("rope_theta", 10000.0)))
    if arch == "gemma3":
        writer.add_sliding_window(cfg["sliding_window"])
    if arch == "qwen3_moe":
        writer.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
        writer.add_expert_used_count(cfg["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    _add_tokenizer(writer, folder)

    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    weights = SafetensorsWeights(folder)
    for name in weights.names():
        tensor = weights.load(name).numpy()
        m = _EXPERT.match(name)
        if m:
            experts.setdefault((int(m.group(1)), m.group(3)), {})[int(m.group(2))] = tensor
            continue
        if arch == "gemma3" and name.endswith("norm.weight"):
            tensor = tensor + 1  # llama.cpp stores Gemma's zero-centred norms as 1 + w
        writer.add_tensor(_gguf_name(arch, name), np.ascontiguousarray(tensor, dtype=np.float32))
    for (layer, proj), by_expert in sorted(experts.items()):
        stacked = np.stack([by_expert[e] for e in sorted(by_expert)])
        writer.add_tensor(f"blk.{layer}.ffn_{proj}_exps.weight", np.ascontiguousarray(stacked, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _add_tokenizer(writer, folder: Path) -> None:
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    for added in tokenizer["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda item: item[1])]
    specials = {a["content"] for a in tokenizer["added_tokens"] if a["special"]}
    merges = [" ".join(m) if isinstance(m, list) else m for m in tokenizer["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in specials else 1 for t in tokens])
    writer.add_token_merges(merges)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    writer.add_bos_token_id(vocab[config["bos_token"]])
    writer.add_eos_token_id(vocab[config["eos_token"]])
    writer.add_pad_token_id(vocab[config["pad_token"]])
    writer.add_add_bos_token(False)
