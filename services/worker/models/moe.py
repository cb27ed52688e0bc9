"""Mixture-of-experts decoders: Qwen3-MoE and Mixtral.

Llama's layers (``llama.py``: Qwen3-MoE with its q/k norms, Mixtral with Mistral's
attention and sliding window) whose MLP is a ``layers.moe.FusedMoE``: Qwen3-MoE's experts
under ``mlp`` (``experts.<e>.gate_proj/up_proj/down_proj``, router ``gate``, top-k weights
renormalised where ``norm_topk_prob`` says), Mixtral's under ``block_sparse_moe``
(``experts.<e>.w1/w3/w2``, always renormalised). LoRA adapts only dense projections, so
these models serve no LoRA adapters (refused at start-up).
"""

from __future__ import annotations

from torch import nn

from ..layers.moe import FusedMoE
from .llama import LlamaDecoderLayer, LlamaForCausalLM


class Qwen3MoeDecoderLayer(LlamaDecoderLayer):
    @staticmethod
    def make_mlp(config, ops, shard, tp, prefix, fused) -> nn.Module:
        return FusedMoE(config, ops, tp, prefix)


class MixtralDecoderLayer(LlamaDecoderLayer):
    @staticmethod
    def make_mlp(config, ops, shard, tp, prefix, fused) -> nn.Module:
        return FusedMoE(config, ops, tp, prefix.replace(".mlp", ".block_sparse_moe"), ("w1", "w3", "w2"))


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    decoder_layer = Qwen3MoeDecoderLayer
    supports_lora = False


class MixtralForCausalLM(LlamaForCausalLM):
    decoder_layer = MixtralDecoderLayer
    supports_lora = False
