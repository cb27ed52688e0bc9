"""The Llama-shaped decoder: Llama 2/3, SmolLM2, Mistral, Qwen2 and Qwen3, and Phi-3.

Pre-norm layers of attention (q/k/v fused into one column-parallel matrix, optionally with
a bias (Qwen2) and a per-head RMSNorm of q and k before the rotary (Qwen3); a sliding
window where the config marks the layer so (Mistral, Qwen2/3, Phi-3)) and a gated MLP
(gate/up fused, SiLU). The families differ only in those config flags, except Phi-3,
whose checkpoints hold q/k/v and gate/up already fused (``Phi3ForCausalLM``: the same
model reading other tensor names, each rank cutting its heads out of the fused tensors).

With ``keep_quantized`` (``--quantization auto``), a GGUF file's int8 / int4 matrices stay
quantized (``layers.linear``); a fused matrix whose parts are not all kept alike is
dequantized instead.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import AttentionMetadata, KernelOps, decode_layers
from kernels.int8_activations import WeightTiles
from shared.model_config import ModelConfig

from ..layers.attention import PagedAttention
from ..layers.embedding import LMHead, VocabEmbedding
from ..layers.linear import Part, column_parallel, row_parallel
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding
from ..parallel import ShardLayout, TensorParallel
from .base import CausalLM


def qkv_parts(config: ModelConfig, shard: ShardLayout, prefix: str, fused: str | None = None) -> list[Part]:
    """This rank's rows of q, k and v: from ``q_proj``/``k_proj``/``v_proj``, or cut out of
    one ``fused`` checkpoint tensor holding all of q's rows, then k's, then v's."""
    hd = config.head_dim
    q_full, kv_full = config.num_attention_heads * hd, config.num_key_value_heads * hd
    q = (shard.head_start * hd, (shard.head_start + shard.num_heads) * hd)
    kv = (shard.kv_head_start * hd, (shard.kv_head_start + shard.num_kv_heads) * hd)
    if fused is None:
        return [Part(f"{prefix}.{name}_proj", full, *rows) for name, full, rows in
                (("q", q_full, q), ("k", kv_full, kv), ("v", kv_full, kv))]
    total = q_full + 2 * kv_full
    return [Part(f"{prefix}.{fused}", total, *q), Part(f"{prefix}.{fused}", total, *kv, offset=q_full),
            Part(f"{prefix}.{fused}", total, *kv, offset=q_full + kv_full)]


def gate_up_parts(intermediate: int, shard_start: int, shard_size: int, prefix: str,
                  fused: str | None = None) -> list[Part]:
    """This rank's columns of gate and up: from ``gate_proj``/``up_proj``, or cut out of one
    ``fused`` tensor holding gate's rows, then up's."""
    rows = (shard_start, shard_start + shard_size)
    if fused is None:
        return [Part(f"{prefix}.gate_proj", intermediate, *rows), Part(f"{prefix}.up_proj", intermediate, *rows)]
    return [Part(f"{prefix}.{fused}", 2 * intermediate, *rows),
            Part(f"{prefix}.{fused}", 2 * intermediate, *rows, offset=intermediate)]


class LlamaAttention(nn.Module):
    """``fused_qkv``: the checkpoint tensor holding q/k/v (Phi-3's), None: separate ones."""

    def __init__(self, config: ModelConfig, ops: KernelOps, shard: ShardLayout, tp: TensorParallel, prefix: str,
                 rotary: RotaryEmbedding, kv_group: int, sliding_window: int | None, qk_norm_offset: bool = False,
                 fused_qkv: str | None = None) -> None:
        super().__init__()
        hd = config.head_dim
        self.q_size, self.kv_size = shard.num_heads * hd, shard.num_kv_heads * hd
        self.head_dim, self.eps = hd, config.rms_norm_eps
        self.qkv_proj = column_parallel(qkv_parts(config, shard, prefix, fused_qkv), config.hidden_size, tp,
                                        bias=config.attention_bias)
        self.o_proj = row_parallel(Part(f"{prefix}.o_proj", config.num_attention_heads * hd, shard.head_start * hd,
                                        (shard.head_start + shard.num_heads) * hd), config.hidden_size, tp)
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            self.q_norm = RMSNorm(hd, config.rms_norm_eps, ops, f"{prefix}.q_norm", offset=qk_norm_offset)
            self.k_norm = RMSNorm(hd, config.rms_norm_eps, ops, f"{prefix}.k_norm", offset=qk_norm_offset)
        self.attn = PagedAttention(shard.num_heads, shard.num_kv_heads, hd, config.attention_scale, rotary, ops,
                                   kv_group, sliding_window)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata, kv_cache) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        # q, k and v stay views of qkv: every kernel takes strided rows.
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        return self.o_proj(self.attn(positions, q, k, v, attn, kv_cache))


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``, act SiLU or GELU-tanh, gate/up fused."""

    def __init__(self, config: ModelConfig, ops: KernelOps, shard: ShardLayout, tp: TensorParallel, prefix: str,
                 fused_gate_up: str | None = None) -> None:
        super().__init__()
        inter = config.intermediate_size
        self.gate_up_proj = column_parallel(
            gate_up_parts(inter, shard.inter_start, shard.intermediate_size, prefix, fused_gate_up),
            config.hidden_size, tp)
        self.down_proj = row_parallel(Part(f"{prefix}.down_proj", inter, shard.inter_start,
                                           shard.inter_start + shard.intermediate_size), config.hidden_size, tp)
        self.act_and_mul = ops.silu_and_mul if config.hidden_act == "silu" else ops.gelu_tanh_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelOps, shard: ShardLayout, tp: TensorParallel, index: int,
                 rotary: RotaryEmbedding, kv_group: int, fused: bool = False) -> None:
        super().__init__()
        prefix = f"model.layers.{index}"
        self.kv_group = kv_group
        self.self_attn = LlamaAttention(config, ops, shard, tp, f"{prefix}.self_attn", rotary, kv_group,
                                        config.layer_sliding_window(index),
                                        fused_qkv="qkv_proj" if fused else None)
        self.mlp = self.make_mlp(config, ops, shard, tp, f"{prefix}.mlp", fused)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, f"{prefix}.input_layernorm")
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops,
                                                f"{prefix}.post_attention_layernorm")

    @staticmethod
    def make_mlp(config, ops, shard, tp, prefix, fused) -> nn.Module:
        return GatedMLP(config, ops, shard, tp, prefix, fused_gate_up="gate_up_proj" if fused else None)

    def forward(self, x, residual, positions, attn: AttentionMetadata, kv_cache):
        x, residual = self.input_layernorm.add_and_norm(x, residual)
        x = self.self_attn(x, positions, attn, kv_cache)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(CausalLM):
    decoder_layer = LlamaDecoderLayer
    fused_checkpoint = False  # q/k/v and gate/up fused in the checkpoint (Phi-3)

    def __init__(self, config: ModelConfig, ops: KernelOps, tp: TensorParallel | None = None) -> None:
        super().__init__(config, ops, tp)
        tp, shard, layout = self.tp, self.shard, self.kv_layout
        rotary = RotaryEmbedding(ops, config.head_dim, config.max_position_embeddings, config.rope_theta,
                                 config.rope_scaling)
        self.embed_tokens = VocabEmbedding(config, shard, tp)
        self.layers = nn.ModuleList(
            self.decoder_layer(config, ops, shard, tp, i, rotary, layout.group_of(i), self.fused_checkpoint)
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, "model.norm")
        self.lm_head = LMHead(config, shard, tp, self.embed_tokens if config.tie_word_embeddings else None)

    def one_token(self, input_ids, positions, attn, kv_caches):
        plan = self._one_token_plan(kv_caches)
        if plan is None or not plan.takes(input_ids, positions, attn[0]):
            return None
        x = None if plan.embedding is not None else self.embed_tokens(input_ids, torch.bfloat16)
        return plan.run(input_ids, positions, attn[0], x)

    def _one_token_plan(self, kv_caches) -> decode_layers.DecodeLayers | None:
        """``kernels.decode_layers``'s driver over these caches, built on the first step
        that asks; None where the layers are not what it runs (or LoRA wraps a product)."""
        cached = getattr(self, "_one_token", None)
        if cached is None or cached[0] is not kv_caches:
            cached = self._one_token = (kv_caches, *self._build_one_token_plan(kv_caches))
        _, plan, products = cached
        if plan is None or not all(layer.proj is proj for layer, proj in products):
            return None
        return plan

    def _build_one_token_plan(self, kv_caches) -> tuple[decode_layers.DecodeLayers | None, list]:
        """(the driver, each product layer with the product the driver stands in for)."""
        from kernels import paged_attention_torch, rms_norm, rotary_write_kv, silu_and_mul

        ops, config = self.ops, self.config
        if not (decode_layers.available() and not self.tp.enabled and self.embed_tokens.scale is None
                and len(self.kv_layout.groups) == 1 and config.hidden_act == "silu"
                and ops.rms_norm in (rms_norm.rms_norm_cpu, rms_norm.rms_norm_cpu_c)
                and ops.silu_and_mul in (silu_and_mul.silu_and_mul_cpu, silu_and_mul.silu_and_mul_cpu_c)
                and ops.rotary_write_kv is rotary_write_kv.rotary_write_kv_cpu
                and ops.paged_attention in (paged_attention_torch.paged_attention_cpu,
                                            paged_attention_torch.paged_attention_cpu_batch_invariant)):
            return None, []
        layers, products = [], []
        for layer, (key_cache, value_cache) in zip(self.layers, kv_caches):
            attention, mlp = layer.self_attn, layer.mlp
            if (type(layer) is not LlamaDecoderLayer or type(mlp) is not GatedMLP or attention.q_norm is not None
                    or attention.qkv_proj.bias is not None or attention.attn.rotary is not self.layers[0].self_attn.attn.rotary
                    or any(norm.offset for norm in (layer.input_layernorm, layer.post_attention_layernorm))):
                return None, []
            linears = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
            products += [(linear, linear.proj) for linear in linears]
            layers.append(decode_layers.LayerWeights(
                layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                *(linear.quantized for linear in linears), key_cache, value_cache))
        first = self.layers[0].self_attn
        shape = decode_layers.DecoderShape(config.hidden_size, first.attn.num_heads, first.attn.num_kv_heads,
                                           first.head_dim, config.intermediate_size, config.rms_norm_eps, first.attn.scale)
        if self.norm.offset or len(layers) != len(self.layers):
            return None, []
        table = self.embed_tokens.quantized
        plan = decode_layers.DecodeLayers.build(shape, layers, self.norm.weight, first.attn.rotary.cos_sin_cache,
                                                self.kv_layout.groups[0].sliding_window,
                                                table if isinstance(table, WeightTiles) else None)
        return plan, products


class Phi3ForCausalLM(LlamaForCausalLM):
    fused_checkpoint = True
