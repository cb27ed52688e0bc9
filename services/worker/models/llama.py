"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) over a paged KV cache.

The model sees one flat batch of tokens from many requests (prompt chunks and
decodes mixed) and calls kernels only through ``KernelOps``, so the same code
runs the PyTorch references on CPU and Triton on CUDA. Weights arrive under
Hugging Face names (see ``shared/model_files.py``); q/k/v and gate/up are fused
into one matrix each at load. With ``keep_quantized`` (``--quantization auto``), a GGUF
file's int8 / int4 matrices stay quantized (``shared/gguf_quants.py``): their products
and the embedding lookup read the blocks (``..linear.quantized_linear``), and the float
parameter they would have filled is left empty (on CPU the matrices are kept as the
int8-activation kernel's tiles, ``..linear.cpu_layout``, and the embedding lookup unpacks
its rows from them); a fused matrix whose parts are not all kept alike is dequantized
instead.

Tensor parallelism (``ShardLayout`` / ``TensorParallel`` from ``..parallel``): each
rank holds its query heads' rows of q/k/v (KV heads split across ranks, or the one
KV head its query heads read when there are fewer KV heads than ranks), its slice
of the MLP's intermediate columns, and its slice of the (padded) vocabulary. o_proj
and down_proj are row-parallel (partial sums, then an all-reduce); the embedding
looks up only its vocabulary rows (zeros elsewhere, then an all-reduce); the LM head
computes its vocabulary slice of the logits and all-gathers the full row. With one
rank every one of those steps is the plain single-device code, chosen at
construction: no collective and no branch runs in the forward pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from kernels import AttentionMetadata, KernelOps
from kernels.int8_activations import WeightTiles
from shared.gguf_quants import QuantizedTensor
from shared.model_config import ModelConfig

from ..linear import Linear, cpu_layout, dequantize, plain_linear, quantized_embedding, quantized_linear
from ..parallel import ShardLayout, TensorParallel


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


@dataclass(frozen=True)
class RowParallel:
    """A row-parallel product: this rank's partial sum ``linear(x)``, then the all-reduce
    (LoRA adds its own partial sum to ``linear``'s, before the all-reduce)."""

    linear: Linear
    all_reduce: object

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.all_reduce(self.linear(x))


def row_parallel(tp: TensorParallel, linear: Linear) -> Linear:
    """A ``RowParallel`` product (with one rank, ``linear`` itself)."""
    return RowParallel(linear, tp.all_reduce) if tp.enabled else linear


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelOps, shard: ShardLayout, tp: TensorParallel) -> None:
        super().__init__()
        self.ops = ops
        self.head_dim = config.head_dim
        self.num_heads = shard.num_heads  # on this rank
        self.num_kv_heads = shard.num_kv_heads  # on this rank
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
        self.tp = tp
        self.qkv_proj = plain_linear(self, "qkv_weight", "qkv_bias" if config.attention_bias else None)
        self.o_proj = row_parallel(tp, plain_linear(self, "o_weight"))
        self.quantized: dict[str, QuantizedTensor | WeightTiles] = {}  # kept quantized; their parameters are empty

    def keep_quantized(self, weight: str, tensor: QuantizedTensor | WeightTiles) -> None:
        if weight == "qkv_weight":
            self.qkv_proj = quantized_linear(tensor, self.qkv_bias, self.ops.batch_invariant)
        else:
            self.o_proj = row_parallel(self.tp, quantized_linear(tensor, batch_invariant=self.ops.batch_invariant))
        self.quantized[weight] = tensor

    def prepack(self, pack) -> None:
        if "qkv_weight" not in self.quantized:
            self.qkv_proj = pack(self.qkv_weight, self.qkv_bias)
        if "o_weight" not in self.quantized:
            self.o_proj = row_parallel(self.tp, pack(self.o_weight))

    def forward(self, x, positions, attn: AttentionMetadata, kv_cache, cos_sin_cache):
        qkv = self.qkv_proj(x)
        # q, k and v stay views of qkv: every kernel takes strided rows.
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        num_tokens = x.shape[0]
        k_cache, v_cache = kv_cache
        self.ops.rotary_write_kv(positions, q, k, v, cos_sin_cache, self.head_dim, k_cache, v_cache, attn.slot_mapping)
        out = self.ops.paged_attention(
            q.view(num_tokens, self.num_heads, self.head_dim), k_cache, v_cache, attn, self.scale
        )
        return self.o_proj(out.view(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelOps, shard: ShardLayout, tp: TensorParallel) -> None:
        super().__init__()
        self.ops = ops
        inter = shard.intermediate_size  # on this rank
        self.gate_up_weight = nn.Parameter(torch.empty(2 * inter, config.hidden_size), requires_grad=False)
        self.down_weight = nn.Parameter(torch.empty(config.hidden_size, inter), requires_grad=False)
        self.tp = tp
        self.gate_up_proj = plain_linear(self, "gate_up_weight")
        self.down_proj = row_parallel(tp, plain_linear(self, "down_weight"))
        self.quantized: dict[str, QuantizedTensor | WeightTiles] = {}  # kept quantized; their parameters are empty

    def keep_quantized(self, weight: str, tensor: QuantizedTensor | WeightTiles) -> None:
        if weight == "gate_up_weight":
            self.gate_up_proj = quantized_linear(tensor, batch_invariant=self.ops.batch_invariant)
        else:
            self.down_proj = row_parallel(self.tp, quantized_linear(tensor, batch_invariant=self.ops.batch_invariant))
        self.quantized[weight] = tensor

    def prepack(self, pack) -> None:
        if "gate_up_weight" not in self.quantized:
            self.gate_up_proj = pack(self.gate_up_weight)
        if "down_weight" not in self.quantized:
            self.down_proj = row_parallel(self.tp, pack(self.down_weight))

    def forward(self, x):
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelOps, shard: ShardLayout, tp: TensorParallel) -> None:
        super().__init__()
        self.ops = ops
        self.eps = config.rms_norm_eps
        self.self_attn = LlamaAttention(config, ops, shard, tp)
        self.mlp = LlamaMLP(config, ops, shard, tp)
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


@dataclass
class _WeightSlot:
    """Where one checkpoint tensor goes: ``target`` receives ``tensor.narrow(dim, start, stop)``
    of the full tensor of shape ``full_shape`` (``dim`` None: the whole tensor)."""

    target: torch.Tensor
    full_shape: tuple[int, ...]
    dim: int | None = None
    start: int = 0
    stop: int = 0


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelOps, tp: TensorParallel | None = None) -> None:
        super().__init__()
        tp = tp or TensorParallel.single()
        self.config = config
        self.ops = ops
        self.tp = tp
        self.shard = ShardLayout.for_rank(config, tp.rank, tp.world_size)
        vocab_rows = self.shard.vocab_per_rank if tp.enabled else config.vocab_size
        # Rows past the true vocabulary (padding on the last rank(s)) stay zero.
        self.embed_weight = nn.Parameter(torch.zeros(vocab_rows, config.hidden_size), requires_grad=False)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, ops, self.shard, tp) for _ in range(config.num_hidden_layers)
        )
        self.norm = nn.Parameter(torch.empty(config.hidden_size), requires_grad=False)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Parameter(torch.zeros(vocab_rows, config.hidden_size), requires_grad=False)
        )
        self.register_buffer(
            "cos_sin_cache",
            ops.compute_cos_sin_cache(
                config.head_dim, config.max_position_embeddings, config.rope_theta, rope_inv_freq(config)
            ),
            persistent=False,
        )
        # Single-device or vocab-parallel embedding and LM head, fixed here once.
        self.embed = self._embed_vocab_parallel if tp.enabled else self._embed
        self.compute_logits = self._logits_vocab_parallel if tp.enabled else self._logits
        self.lm_head_proj = plain_linear(self, "embed_weight" if self.lm_head is None else "lm_head")
        # "embed_weight" / "lm_head" kept quantized (a tied LM head reads the embedding's).
        self.quantized: dict[str, QuantizedTensor | WeightTiles] = {}
        self.prepacked_bytes = 0

    def prepack_linears(self, pack) -> None:
        """Lay every float weight matrix out once for its products with ``pack`` (oneDNN's
        prepacking or the batch-invariant kernel's tiles, ``..linear.weight_packer``). The
        products then read only the packed copies, so the checkpoint-layout matrices are
        dropped, except the embedding, which the token lookup still reads."""
        for layer in self.layers:
            for module, names in ((layer.self_attn, ("qkv_weight", "o_weight")),
                                  (layer.mlp, ("gate_up_weight", "down_weight"))):  # fmt: skip
                module.prepack(pack)
                for name in names:
                    self._drop_prepacked(getattr(module, name))
        if "lm_head" in self.quantized or (self.lm_head is None and "embed_weight" in self.quantized):
            return
        self.lm_head_proj = pack(self._lm_weight())
        if self.lm_head is None:
            self.prepacked_bytes += self.embed_weight.nbytes
        else:
            self._drop_prepacked(self.lm_head)

    def _drop_prepacked(self, param: nn.Parameter) -> None:
        self.prepacked_bytes += param.nbytes  # the reordered copy holds as many values
        param.data = torch.empty(0, dtype=param.dtype)

    def num_quantized(self) -> int:
        """How many (fused) matrices are kept quantized."""
        return len(self.quantized) + sum(len(m.quantized) for layer in self.layers for m in (layer.self_attn, layer.mlp))

    def weight_bytes(self) -> int:
        """Bytes of the weights: float parameters, oneDNN's reordered copies and the
        tensors kept quantized."""
        modules = [self, *(m for layer in self.layers for m in (layer.self_attn, layer.mlp))]
        return sum(p.nbytes for p in self.parameters()) + self.prepacked_bytes + sum(
            t.nbytes() for m in modules for t in m.quantized.values())

    def forward(self, input_ids, positions, attn: AttentionMetadata, kv_caches) -> torch.Tensor:
        x = self.embed(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, positions, attn, kv_cache, self.cos_sin_cache)
        x, _ = self.ops.rms_norm(x, self.norm, self.config.rms_norm_eps, residual)
        return x

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(input_ids, self.embed_weight)

    def _embed_quantized(self, input_ids: torch.Tensor) -> torch.Tensor:
        return quantized_embedding(self.quantized["embed_weight"], input_ids, self.norm.dtype)

    def _embed_vocab_parallel(self, input_ids: torch.Tensor) -> torch.Tensor:
        start = self.shard.vocab_start
        outside = (input_ids < start) | (input_ids >= start + self.shard.vocab_per_rank)
        x = nn.functional.embedding((input_ids - start).masked_fill_(outside, 0), self.embed_weight)
        x.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(x)

    def _lm_weight(self) -> torch.Tensor:
        return self.embed_weight if self.lm_head is None else self.lm_head

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> full logits ``[N, vocab]`` in float32."""
        return self.lm_head_proj(hidden).float()

    def _logits_vocab_parallel(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.lm_head_proj(hidden)
        return self.tp.all_gather_last_dim(local)[:, : self.config.vocab_size].float()

    # ------------------------------------------------------------------ loading

    def _weight_plan(self) -> dict[str, _WeightSlot]:
        """Every checkpoint tensor this rank needs, under its HF name, and where it goes."""
        cfg, shard = self.config, self.shard
        hd, hidden = cfg.head_dim, cfg.hidden_size
        q_full, kv_full = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
        inter_full = cfg.intermediate_size
        q_size, kv_size, inter = shard.num_heads * hd, shard.num_kv_heads * hd, shard.intermediate_size
        q_start, kv_start = shard.head_start * hd, shard.kv_head_start * hd
        i_start = shard.inter_start
        plan: dict[str, _WeightSlot] = {}

        def add(name, target, full_shape, dim=None, start=0, stop=0):
            if dim is not None and start == 0 and stop == full_shape[dim]:
                dim = None  # the whole tensor (always so with one rank)
            plan[name] = _WeightSlot(target, tuple(full_shape), dim, start, stop)

        v_start, v_stop = shard.vocab_start, shard.vocab_stop
        if self.tp.enabled:
            vocab_slice = slice(0, v_stop - v_start)
        else:
            v_start, v_stop, vocab_slice = 0, cfg.vocab_size, slice(None)
        add("model.embed_tokens.weight", self.embed_weight.data[vocab_slice], (cfg.vocab_size, hidden), 0, v_start, v_stop)
        if self.lm_head is not None:
            add("lm_head.weight", self.lm_head.data[vocab_slice], (cfg.vocab_size, hidden), 0, v_start, v_stop)
        add("model.norm.weight", self.norm.data, (hidden,))
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            qkv = attn.qkv_weight.data
            rows = {
                "q": (slice(0, q_size), q_full, q_start, q_start + q_size),
                "k": (slice(q_size, q_size + kv_size), kv_full, kv_start, kv_start + kv_size),
                "v": (slice(q_size + kv_size, q_size + 2 * kv_size), kv_full, kv_start, kv_start + kv_size),
            }
            for key, (local, full, start, stop) in rows.items():
                add(f"{p}self_attn.{key}_proj.weight", qkv[local], (full, hidden), 0, start, stop)
                if attn.qkv_bias is not None:
                    add(f"{p}self_attn.{key}_proj.bias", attn.qkv_bias.data[local], (full,), 0, start, stop)
            add(f"{p}self_attn.o_proj.weight", attn.o_weight.data, (hidden, q_full), 1, q_start, q_start + q_size)
            gate_up = mlp.gate_up_weight.data
            add(f"{p}mlp.gate_proj.weight", gate_up[:inter], (inter_full, hidden), 0, i_start, i_start + inter)
            add(f"{p}mlp.up_proj.weight", gate_up[inter:], (inter_full, hidden), 0, i_start, i_start + inter)
            add(f"{p}mlp.down_proj.weight", mlp.down_weight.data, (hidden, inter_full), 1, i_start, i_start + inter)
            add(f"{p}input_layernorm.weight", layer.input_norm.data, (hidden,))
            add(f"{p}post_attention_layernorm.weight", layer.post_attn_norm.data, (hidden,))
        return plan

    @staticmethod
    def _put(slot: _WeightSlot, tensor: torch.Tensor, name: str) -> None:
        if slot.target.shape != tensor.shape:
            raise ValueError(f"weight {name}: expected shape {tuple(slot.target.shape)}, got {tuple(tensor.shape)}")
        slot.target.copy_(tensor)

    @staticmethod
    def _check_full_shape(slot: _WeightSlot, shape, name: str) -> None:
        if tuple(shape) != slot.full_shape:
            raise ValueError(f"weight {name}: expected shape {slot.full_shape}, got {tuple(shape)}")

    def _check_complete(self, plan: dict[str, _WeightSlot], loaded: set[str]) -> None:
        missing = sorted(set(plan) - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")

    def load_weights(self, weights) -> None:
        """Copy (hf_name, full tensor) pairs into this rank's (fused) parameters, taking
        this rank's shard of each; every weight must arrive. Unknown names are skipped."""
        plan = self._weight_plan()
        loaded: set[str] = set()
        for name, tensor in weights:
            slot = plan.get(name)
            if slot is None:
                continue
            if slot.dim is not None:
                self._check_full_shape(slot, tensor.shape, name)
                tensor = tensor.narrow(slot.dim, slot.start, slot.stop - slot.start)
            self._put(slot, tensor, name)
            loaded.add(name)
        self._check_complete(plan, loaded)

    def load_weights_from(self, source, dtype: torch.dtype = torch.float32, keep_quantized: bool = False) -> None:
        """Load from a ``WeightSource`` (``shared.model_files.open_weights``), reading only
        this rank's rows / columns of each sharded tensor with ``load_slice``.
        ``keep_quantized``: matrices the source holds as int8 / int4 stay so (whole
        tensors only, i.e. one rank)."""
        plan = self._weight_plan()
        loaded: set[str] = set()
        kept: dict[str, QuantizedTensor] = {}
        for name in source.names():
            slot = plan.get(name)
            if slot is None:
                continue
            if keep_quantized and slot.dim is None and slot.target.dim() == 2:
                tensor = source.load_quantized(name)
                if tensor is not None:
                    kept[name] = tensor
                    loaded.add(name)
                    continue
            if slot.dim is None:
                tensor = source.load(name, dtype)
            else:
                self._check_full_shape(slot, source.shape(name), name)
                if slot.stop == slot.start:  # a rank holding only vocabulary padding
                    loaded.add(name)
                    continue
                tensor = source.load_slice(name, slot.dim, slot.start, slot.stop, dtype)
            self._put(slot, tensor, name)
            loaded.add(name)
        self._check_complete(plan, loaded)
        if kept:
            self._keep_quantized(plan, kept)

    def _keep_quantized(self, plan: dict[str, _WeightSlot], kept: dict[str, QuantizedTensor]) -> None:
        """Hand each fully quantized (fused) matrix to its module and empty its parameter;
        dequantize into the parameter the parts of a matrix whose parts are not all kept alike."""
        device = self.norm.device
        matrices = [(self, "embed_weight", ["model.embed_tokens.weight"])]
        if self.lm_head is not None:
            matrices.append((self, "lm_head", ["lm_head.weight"]))
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            matrices += [
                (layer.self_attn, "qkv_weight", [f"{p}self_attn.{key}_proj.weight" for key in "qkv"]),
                (layer.self_attn, "o_weight", [f"{p}self_attn.o_proj.weight"]),
                (layer.mlp, "gate_up_weight", [f"{p}mlp.gate_proj.weight", f"{p}mlp.up_proj.weight"]),
                (layer.mlp, "down_weight", [f"{p}mlp.down_proj.weight"]),
            ]
        for module, weight, names in matrices:
            parts = [kept.get(name) for name in names]
            if all(parts) and len({part.bits for part in parts}) == 1:
                tensor = QuantizedTensor.cat(parts).to(device) if len(parts) > 1 else parts[0].to(device)
                param = getattr(module, weight)
                param.data = torch.empty(0, dtype=param.dtype, device=device)
                if module is self:  # the embedding (its lookups unpack rows of tiles) / LM head
                    self.quantized[weight] = cpu_layout(tensor)
                else:
                    module.keep_quantized(weight, cpu_layout(tensor))
                continue
            for name, part in zip(names, parts):
                if part is not None:
                    self._put(plan[name], dequantize(part), name)
        invariant = self.ops.batch_invariant
        if "embed_weight" in self.quantized:
            self.embed = self._embed_quantized
            if self.lm_head is None:
                self.lm_head_proj = quantized_linear(self.quantized["embed_weight"], batch_invariant=invariant)
        if "lm_head" in self.quantized:
            self.lm_head_proj = quantized_linear(self.quantized["lm_head"], batch_invariant=invariant)
