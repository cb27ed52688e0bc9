"""What every model offers the worker (``CausalLM``), and the decoder skeleton they share.

The model runner, the draft model and the LoRA slots use a model only through this
interface:

- ``forward(input_ids, positions, attn, kv_caches)``: one flat batch of tokens from many
  requests (prompt chunks and decodes mixed) -> hidden states ``[T, hidden]``. ``attn``
  holds the step's ``AttentionMetadata`` per KV cache group, ``kv_caches`` each layer's
  (key, value) cache tensors (``kv_cache_spec`` says which layers share them).
- ``compute_logits(hidden)``: ``[N, hidden]`` -> full float32 logits ``[N, vocab]``.
- ``load_weights_from(source, dtype, keep_quantized)`` / ``load_weights(pairs)``: weights
  under Hugging Face names (``layers.weights``).
- ``kv_cache_spec()``: the KV cache this rank needs (groups, KV heads, head size).
- ``lora_targets()``: per decoder layer, the projection layers LoRA adapts
  (``shared.lora.FUSED_PROJECTIONS``'s names).
- ``prepack_linears(pack)``, ``weight_bytes()``, ``num_quantized()``.

The model sees kernels only through ``KernelOps``, so the same code runs the PyTorch and
C kernels on CPU and Triton on CUDA. Under tensor parallelism (``ShardLayout`` /
``TensorParallel`` from ``..parallel``) every layer holds its rank's shard and the
collectives are chosen at construction; with one rank no collective and no branch runs in
the forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kernels import AttentionMetadata, KernelOps
from shared.kv_cache_groups import KVCacheLayout, model_kv_cache_layout
from shared.model_config import ModelConfig

from ..layers.embedding import LMHead, VocabEmbedding
from ..layers.linear import LinearLayer
from ..layers.norm import RMSNorm
from ..layers.weights import load_model_weights, load_weights
from ..parallel import ShardLayout, TensorParallel


@dataclass(frozen=True)
class KVCacheSpec:
    """The KV cache of one rank: the layer groups (``shared.kv_cache_groups``), and every
    layer's KV heads on this rank and head size (the same for all layers)."""

    layout: KVCacheLayout
    num_kv_heads: int
    head_dim: int


class CausalLM(nn.Module):
    """A decoder: ``embed_tokens``, ``layers`` (each called as
    ``layer(x, residual, positions, attn, kv_cache) -> (x, residual)``), the final ``norm``
    and ``lm_head``, which a subclass builds in its ``__init__`` after this one's."""

    embed_tokens: VocabEmbedding
    layers: nn.ModuleList
    norm: RMSNorm
    lm_head: LMHead
    # Whether LoRA adapters (of the dense projections, lora_targets) can be served.
    supports_lora = True

    def __init__(self, config: ModelConfig, ops: KernelOps, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.config, self.ops = config, ops
        self.tp = tp = tp or TensorParallel.single()
        self.shard = ShardLayout.for_rank(config, tp.rank, tp.world_size)
        self.kv_layout = model_kv_cache_layout(config)
        self.prepacked_bytes = 0

    # ------------------------------------------------------------------ running

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: list[AttentionMetadata],
                kv_caches) -> torch.Tensor:
        if input_ids.shape[0] == 1:
            hidden = self.one_token(input_ids, positions, attn, kv_caches)
            if hidden is not None:
                return hidden
        x = self.embed_tokens(input_ids, self.norm.weight.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, positions, attn[layer.kv_group], kv_cache)
        x, _ = self.norm(x, residual)
        return x

    def one_token(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: list[AttentionMetadata],
                  kv_caches) -> torch.Tensor | None:
        """``forward`` for a step of one token in one call, where the model has such a path
        and it takes this step (the same result as the layers one by one, bit for bit);
        else None."""
        return None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> full logits ``[N, vocab]`` in float32."""
        return self.lm_head(hidden)

    # ------------------------------------------------------------------ what the worker asks

    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(self.kv_layout, self.shard.num_kv_heads, self.config.head_dim)

    def lora_targets(self) -> list[dict[str, LinearLayer]]:
        """Per decoder layer, projection name -> the layer whose ``proj`` LoRA wraps."""
        return [{"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj,
                 "gate_up": layer.mlp.gate_up_proj, "down": layer.mlp.down_proj} for layer in self.layers]

    # ------------------------------------------------------------------ weights

    def load_weights(self, weights) -> None:
        """Copy ``(hf_name, full tensor)`` pairs into this rank's (fused) parameters; every
        weight must arrive, unknown names are skipped."""
        load_weights(self, weights)

    def load_weights_from(self, source, dtype: torch.dtype = torch.float32, keep_quantized: bool = False) -> None:
        """Load from a ``WeightSource`` (``shared.model_files.open_weights``), reading only
        this rank's rows / columns of each sharded tensor. ``keep_quantized``: matrices the
        source holds as int8 / int4 stay so (whole tensors only, i.e. one rank)."""
        load_model_weights(self, source, dtype, keep_quantized, self.ops.batch_invariant)

    def prepack_linears(self, pack) -> None:
        """Lay every float weight matrix out once for its products with ``pack`` (oneDNN's
        prepacking or the batch-invariant kernel's tiles, ``..linear.weight_packer``). The
        products then read only the packed copies, so the checkpoint-layout matrices are
        dropped, except the embedding, which the token lookup still reads."""
        for module in self.modules():
            if isinstance(module, LinearLayer):
                self.prepacked_bytes += module.prepack(pack)
        self.prepacked_bytes += self.lm_head.prepack(pack)

    def _quantizable(self):
        return [m for m in self.modules() if isinstance(m, (LinearLayer, VocabEmbedding, LMHead))]

    def num_quantized(self) -> int:
        """How many (fused) matrices are kept quantized."""
        return sum(m.quantized is not None for m in self._quantizable())

    def weight_bytes(self) -> int:
        """Bytes of the weights: float parameters, oneDNN's reordered copies and the
        tensors kept quantized."""
        return (sum(p.nbytes for p in self.parameters()) + self.prepacked_bytes
                + sum(m.quantized_bytes() for m in self._quantizable()))
