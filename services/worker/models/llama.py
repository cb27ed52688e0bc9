"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) over a paged KV cache.

The model sees one flat batch of tokens from many requests (prompt chunks and
decodes mixed) and calls kernels only through ``KernelOps``, so the same code
runs the PyTorch references on CPU and Triton on CUDA. Weights arrive under
Hugging Face names (see ``shared/model_files.py``); q/k/v and gate/up are fused
into one matrix each at load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from kernels.rotary import compute_cos_sin_cache
from shared.model_config import ModelConfig


@dataclass
class AttentionMetadata:
    """Where each token's K/V goes and which cached context each request attends to."""

    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    max_query_len: int
    max_seq_len: int


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", scaling.get("type")) == "llama3":
        factor = scaling["factor"]
        low_freq_factor = scaling["low_freq_factor"]
        high_freq_factor = scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_freq_wavelen = old_len / low_freq_factor
        high_freq_wavelen = old_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, ops) -> None:
        super().__init__()
        self.ops = ops
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        hidden = config.hidden_size
        self.qkv_weight = nn.Parameter(torch.empty(self.q_size + 2 * self.kv_size, hidden), requires_grad=False)
        self.qkv_bias = (
            nn.Parameter(torch.empty(self.q_size + 2 * self.kv_size), requires_grad=False)
            if config.attention_bias
            else None
        )
        self.o_weight = nn.Parameter(torch.empty(hidden, self.q_size), requires_grad=False)

    def forward(self, x, positions, attn: AttentionMetadata, kv_cache, cos_sin_cache):
        qkv = nn.functional.linear(x, self.qkv_weight, self.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.contiguous()
        k = k.contiguous()
        self.ops.rotary_embedding(positions, q, k, cos_sin_cache, self.head_dim)
        num_tokens = x.shape[0]
        k_cache, v_cache = kv_cache
        self.ops.write_kv(
            k.view(num_tokens, self.num_kv_heads, self.head_dim),
            v.reshape(num_tokens, self.num_kv_heads, self.head_dim),
            k_cache,
            v_cache,
            attn.slot_mapping,
        )
        out = self.ops.paged_attention(
            q.view(num_tokens, self.num_heads, self.head_dim),
            k_cache,
            v_cache,
            attn.block_tables,
            attn.query_start_loc,
            attn.seq_lens,
            self.scale,
            attn.max_query_len,
            attn.max_seq_len,
        )
        return nn.functional.linear(out.view(num_tokens, self.q_size), self.o_weight)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, ops) -> None:
        super().__init__()
        self.ops = ops
        inter = config.intermediate_size
        self.gate_up_weight = nn.Parameter(torch.empty(2 * inter, config.hidden_size), requires_grad=False)
        self.down_weight = nn.Parameter(torch.empty(config.hidden_size, inter), requires_grad=False)

    def forward(self, x):
        return nn.functional.linear(
            self.ops.silu_and_mul(nn.functional.linear(x, self.gate_up_weight)), self.down_weight
        )


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, ops) -> None:
        super().__init__()
        self.ops = ops
        self.eps = config.rms_norm_eps
        self.self_attn = LlamaAttention(config, ops)
        self.mlp = LlamaMLP(config, ops)
        self.input_norm = nn.Parameter(torch.empty(config.hidden_size), requires_grad=False)
        self.post_attn_norm = nn.Parameter(torch.empty(config.hidden_size), requires_grad=False)

    def forward(self, x, residual, positions, attn, kv_cache, cos_sin_cache):
        if residual is None:
            residual = x
            x = self.ops.rms_norm(x, self.input_norm, self.eps)
        else:
            x, residual = self.ops.rms_norm(x, self.input_norm, self.eps, residual)
        x = self.self_attn(x, positions, attn, kv_cache, cos_sin_cache)
        x, residual = self.ops.rms_norm(x, self.post_attn_norm, self.eps, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, ops) -> None:
        super().__init__()
        self.config = config
        self.ops = ops
        self.embed_weight = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size), requires_grad=False)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, ops) for _ in range(config.num_hidden_layers)
        )
        self.norm = nn.Parameter(torch.empty(config.hidden_size), requires_grad=False)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Parameter(torch.empty(config.vocab_size, config.hidden_size), requires_grad=False)
        )
        self.register_buffer(
            "cos_sin_cache",
            compute_cos_sin_cache(
                config.head_dim, config.max_position_embeddings, config.rope_theta, rope_inv_freq(config)
            ),
            persistent=False,
        )

    def forward(self, input_ids, positions, attn: AttentionMetadata, kv_caches) -> torch.Tensor:
        x = nn.functional.embedding(input_ids, self.embed_weight)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, positions, attn, kv_cache, self.cos_sin_cache)
        x, _ = self.ops.rms_norm(x, self.norm, self.config.rms_norm_eps, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_weight if self.lm_head is None else self.lm_head
        return nn.functional.linear(hidden, weight).float()

    # ------------------------------------------------------------------ loading

    def load_weights(self, weights) -> None:
        """Copy (hf_name, tensor) pairs into the fused parameters; every one must arrive."""
        cfg = self.config
        q_size = cfg.num_attention_heads * cfg.head_dim
        kv_size = cfg.num_key_value_heads * cfg.head_dim
        inter = cfg.intermediate_size
        loaded: set[str] = set()

        def put(param: torch.Tensor, tensor: torch.Tensor, rows: slice | None = None, key: str = "") -> None:
            target = param if rows is None else param[rows]
            if target.shape != tensor.shape:
                raise ValueError(f"weight {key}: expected shape {tuple(target.shape)}, got {tuple(tensor.shape)}")
            target.copy_(tensor)
            loaded.add(key)

        for name, tensor in weights:
            if name == "model.embed_tokens.weight":
                put(self.embed_weight.data, tensor, key=name)
                continue
            if name == "model.norm.weight":
                put(self.norm.data, tensor, key=name)
                continue
            if name == "lm_head.weight":
                if self.lm_head is not None:
                    put(self.lm_head.data, tensor, key=name)
                continue
            parts = name.split(".")
            if parts[:2] != ["model", "layers"]:
                continue
            layer = self.layers[int(parts[2])]
            suffix = ".".join(parts[3:])
            attn, mlp = layer.self_attn, layer.mlp
            qkv_rows = {
                "q": slice(0, q_size),
                "k": slice(q_size, q_size + kv_size),
                "v": slice(q_size + kv_size, q_size + 2 * kv_size),
            }
            if suffix in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"):
                put(attn.qkv_weight.data, tensor, qkv_rows[parts[4][0]], name)
            elif suffix in ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"):
                if attn.qkv_bias is not None:
                    put(attn.qkv_bias.data, tensor, qkv_rows[parts[4][0]], name)
            elif suffix == "self_attn.o_proj.weight":
                put(attn.o_weight.data, tensor, key=name)
            elif suffix == "mlp.gate_proj.weight":
                put(mlp.gate_up_weight.data, tensor, slice(0, inter), name)
            elif suffix == "mlp.up_proj.weight":
                put(mlp.gate_up_weight.data, tensor, slice(inter, 2 * inter), name)
            elif suffix == "mlp.down_proj.weight":
                put(mlp.down_weight.data, tensor, key=name)
            elif suffix == "input_layernorm.weight":
                put(layer.input_norm.data, tensor, key=name)
            elif suffix == "post_attention_layernorm.weight":
                put(layer.post_attn_norm.data, tensor, key=name)
        expected = {"model.embed_tokens.weight", "model.norm.weight"}
        if self.lm_head is not None:
            expected.add("lm_head.weight")
        for i in range(cfg.num_hidden_layers):
            for w in ("q_proj", "k_proj", "v_proj", "o_proj"):
                expected.add(f"model.layers.{i}.self_attn.{w}.weight")
            for w in ("gate_proj", "up_proj", "down_proj"):
                expected.add(f"model.layers.{i}.mlp.{w}.weight")
            expected.add(f"model.layers.{i}.input_layernorm.weight")
            expected.add(f"model.layers.{i}.post_attention_layernorm.weight")
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")
