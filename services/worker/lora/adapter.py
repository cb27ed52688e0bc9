"""A PEFT LoRA adapter folder read into A/B matrices laid out for our fused projections.

A PEFT folder holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``,
``target_modules``) and ``adapter_model.safetensors`` with, per adapted module,
``...<module>.lora_A.weight`` ``[r, in]`` and ``...<module>.lora_B.weight`` ``[out, r]``.
The model adds ``scaling * B @ A @ x`` to each adapted projection's output, with
``scaling = lora_alpha / r`` (``lora_alpha / sqrt(r)`` under rsLoRA).

Our model fuses q/k/v into one projection and gate/up into another (``models/llama.py``),
so an adapter is stored per layer and *fused* projection: the sub-modules' A matrices
stacked (each padded to ``max_rank`` rows) and their B matrices block-diagonal, with the
scaling folded into B. One shrink ``x @ A.T`` and one expand ``h @ B.T`` then give each
sub-module's delta in its own rows of the fused output; padding rows and absent
sub-modules are zeros, which add exactly nothing.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.model_config import ModelConfig

# Fused projection -> the PEFT module names it holds, in the order of its output rows.
FUSED_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
_MODULE_TO_PROJECTION = {m: p for p, modules in FUSED_PROJECTIONS.items() for m in modules}
SUPPORTED_MODULES = tuple(_MODULE_TO_PROJECTION)
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


class LoRAAdapterError(ValueError):
    """The adapter cannot be served on this model; the message says why (a 400 for clients)."""


@dataclass(frozen=True)
class ProjectionShapes:
    """Input and per-sub-module output sizes of each fused projection (full model, one rank)."""

    in_features: dict[str, int]
    out_features: dict[str, tuple[int, ...]]

    @classmethod
    def of(cls, config: ModelConfig) -> "ProjectionShapes":
        q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
        hidden, inter = config.hidden_size, config.intermediate_size
        return cls(
            in_features={"qkv": hidden, "o": q, "gate_up": hidden, "down": inter},
            out_features={"qkv": (q, kv, kv), "o": (hidden,), "gate_up": (inter, inter), "down": (hidden,)},
        )

    def stacked_rank(self, projection: str, max_rank: int) -> int:
        return len(FUSED_PROJECTIONS[projection]) * max_rank


@dataclass
class LoRAAdapter:
    """One adapter on the host: ``weights[layer][projection] = (A, B)``, A ``[n_sub * max_rank,
    in]``, B ``[sum(out), n_sub * max_rank]`` with the scaling folded in; projections the
    adapter leaves alone are absent."""

    name: str
    path: str
    rank: int
    scaling: float
    weights: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]

    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for layer in self.weights for a, b in layer.values())


def read_adapter_config(path: str | Path, max_rank: int) -> dict:
    """``adapter_config.json`` of the folder, checked against what we can serve."""
    folder = Path(path)
    if not folder.is_dir():
        raise LoRAAdapterError(f"LoRA adapter path {str(path)!r} is not a directory")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / name).is_file():
            raise LoRAAdapterError(f"LoRA adapter folder {str(path)!r} has no {name}")
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LoRAAdapterError(f"cannot read {CONFIG_FILE} of {str(path)!r}: {e}") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"{CONFIG_FILE} of {str(path)!r} is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"adapter type {config.get('peft_type')!r} is not LoRA")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoRAAdapterError(f"adapter_config r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoRAAdapterError(f"LoRA rank {rank} is greater than max_lora_rank {max_rank}")
    refused = {
        "use_dora": bool(config.get("use_dora")),
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
        "modules_to_save": bool(config.get("modules_to_save")),
        "rank_pattern": bool(config.get("rank_pattern")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
        "bias": config.get("bias", "none") not in (None, "none"),
    }
    unsupported = [key for key, present in refused.items() if present]
    if unsupported:
        raise LoRAAdapterError(f"LoRA adapters with {', '.join(unsupported)} are not supported")
    return config


def lora_scaling(config: dict) -> float:
    """PEFT's scaling: lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora."""
    rank = config["r"]
    alpha = config.get("lora_alpha", 8)
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _parse_name(name: str) -> tuple[int, str, str]:
    """``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`` -> (3, q_proj, A)."""
    parts = name.split(".")
    try:
        i = parts.index("layers")
        layer = int(parts[i + 1])
        module, kind, leaf = parts[-3], parts[-2], parts[-1]
    except (ValueError, IndexError):
        raise LoRAAdapterError(f"LoRA weight {name!r} is not in a decoder layer") from None
    if leaf != "weight" or kind not in ("lora_A", "lora_B"):
        raise LoRAAdapterError(f"LoRA weight {name!r} is not a lora_A / lora_B weight")
    if module not in _MODULE_TO_PROJECTION:
        raise LoRAAdapterError(f"LoRA target module {module!r} is not supported "
                               f"(supported: {', '.join(SUPPORTED_MODULES)})")
    return layer, module, kind[-1]


def load_lora_adapter(
    name: str, path: str | Path, model_config: ModelConfig, max_rank: int, dtype: torch.dtype = torch.float32
) -> LoRAAdapter:
    """Read and check the PEFT folder at ``path`` for a model of ``model_config``; raises
    ``LoRAAdapterError`` (bad path, rank above ``max_rank``, a shape or module the base
    model does not have)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config = read_adapter_config(path, max_rank)
    rank, scaling = config["r"], lora_scaling(config)
    try:
        tensors = load_file(str(Path(path) / WEIGHTS_FILE))
    except (OSError, SafetensorError) as e:
        raise LoRAAdapterError(f"cannot read {WEIGHTS_FILE} of {str(path)!r}: {e}") from None
    shapes = ProjectionShapes.of(model_config)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in tensors.items():
        layer, module, kind = _parse_name(tensor_name)
        if not 0 <= layer < model_config.num_hidden_layers:
            raise LoRAAdapterError(f"LoRA weight {tensor_name!r}: the base model has "
                                   f"{model_config.num_hidden_layers} layers")
        pairs.setdefault((layer, module), {})[kind] = tensor
    if not pairs:
        raise LoRAAdapterError(f"LoRA adapter {str(path)!r} has no weights")

    weights: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(model_config.num_hidden_layers)]
    for (layer, module), pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise LoRAAdapterError(f"LoRA module layers.{layer}.{module} lacks lora_A or lora_B")
        projection = _MODULE_TO_PROJECTION[module]
        sub = FUSED_PROJECTIONS[projection].index(module)
        in_features = shapes.in_features[projection]
        outs = shapes.out_features[projection]
        a, b = pair["A"], pair["B"]
        if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (outs[sub], rank):
            raise LoRAAdapterError(
                f"LoRA module layers.{layer}.{module} has A {tuple(a.shape)} and B {tuple(b.shape)}; "
                f"this base model needs A ({rank}, {in_features}) and B ({outs[sub]}, {rank})"
            )
        if projection not in weights[layer]:
            stacked = shapes.stacked_rank(projection, max_rank)
            weights[layer][projection] = (torch.zeros(stacked, in_features, dtype=dtype),
                                          torch.zeros(sum(outs), stacked, dtype=dtype))
        fused_a, fused_b = weights[layer][projection]
        cols = slice(sub * max_rank, sub * max_rank + rank)
        rows = slice(sum(outs[:sub]), sum(outs[: sub + 1]))
        fused_a[cols] = a.to(dtype)
        fused_b[rows, cols] = (b.float() * scaling).to(dtype)
    return LoRAAdapter(name=name, path=str(path), rank=rank, scaling=scaling, weights=weights)
