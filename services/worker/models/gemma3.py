"""Gemma 3 (text): Llama's attention and gated MLP, arranged Gemma's way.

What differs from ``llama.py``: the embedding is scaled by ``sqrt(hidden_size)``; every
RMSNorm is zero-centred (``x_normed * (1 + w)``); each layer normalises before and after
both its attention and its MLP (four norms); queries and keys get a per-head RMSNorm
before the rotary embedding; the MLP's gate is GELU-tanh; the attention scale is
``query_pre_attn_scalar ** -0.5``; and the layers alternate kinds (by default five
sliding-window layers to each global one), the sliding ones with their own rotary base
(``rope_local_theta``) and the global ones with ``rope_theta`` and its scaling. The layers of
each kind form their own KV cache groups (``shared/kv_cache_groups.py``), so a sliding
layer holds only its window of KV.
"""

from __future__ import annotations

from torch import nn

from kernels import AttentionMetadata, KernelOps
from shared.model_config import ModelConfig

from ..layers.embedding import LMHead, VocabEmbedding
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding
from ..parallel import ShardLayout, TensorParallel
from .base import CausalLM
from .llama import GatedMLP, LlamaAttention


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelOps, shard: ShardLayout, tp: TensorParallel, index: int,
                 rotary: RotaryEmbedding, kv_group: int) -> None:
        super().__init__()
        prefix = f"model.layers.{index}"
        self.kv_group = kv_group
        self.self_attn = LlamaAttention(config, ops, shard, tp, f"{prefix}.self_attn", rotary, kv_group,
                                        config.layer_sliding_window(index), qk_norm_offset=True)
        self.mlp = GatedMLP(config, ops, shard, tp, f"{prefix}.mlp")

        def norm(name: str) -> RMSNorm:
            return RMSNorm(config.hidden_size, config.rms_norm_eps, ops, f"{prefix}.{name}", offset=True)

        self.input_layernorm = norm("input_layernorm")
        self.post_attention_layernorm = norm("post_attention_layernorm")
        self.pre_feedforward_layernorm = norm("pre_feedforward_layernorm")
        self.post_feedforward_layernorm = norm("post_feedforward_layernorm")

    def forward(self, x, residual, positions, attn: AttentionMetadata, kv_cache):
        # ``x + residual`` is the hidden state: each add is fused into the next norm.
        x, residual = self.input_layernorm.add_and_norm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(x, positions, attn, kv_cache))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma3ForCausalLM(CausalLM):
    def __init__(self, config: ModelConfig, ops: KernelOps, tp: TensorParallel | None = None) -> None:
        super().__init__(config, ops, tp)
        tp, shard, layout = self.tp, self.shard, self.kv_layout
        max_positions = config.max_position_embeddings
        full = RotaryEmbedding(ops, config.head_dim, max_positions, config.rope_theta, config.rope_scaling)
        local = RotaryEmbedding(ops, config.head_dim, max_positions, config.rope_local_theta or config.rope_theta)
        self.embed_tokens = VocabEmbedding(config, shard, tp, scale=config.hidden_size**0.5)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, ops, shard, tp, i, full if config.layer_sliding_window(i) is None else local,
                               layout.group_of(i))
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, "model.norm", offset=True)
        self.lm_head = LMHead(config, shard, tp, self.embed_tokens if config.tie_word_embeddings else None)
