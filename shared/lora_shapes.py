"""What a LoRA adapter must look like to run on a base model, whatever its file format.

Our models fuse projections (q/k/v, gate/up); an adapter names PEFT's modules. This maps
one to the other, gives each fused projection's shapes for a ``ModelConfig``, and checks
an adapter's A/B pairs against them: the PEFT folder reader (``shared/lora.py``) and the
GGUF LoRA reader (``shared/lora_gguf.py``) share these checks.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.model_config import ModelConfig

# Fused projection of our model -> the PEFT module names it holds, in the order of its output rows.
FUSED_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
MODULE_TO_PROJECTION = {m: p for p, modules in FUSED_PROJECTIONS.items() for m in modules}


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


def check_module_shapes(layer: int, module: str, a_shape, b_shape, rank: int, shapes: ProjectionShapes) -> None:
    projection = MODULE_TO_PROJECTION[module]
    in_features = shapes.in_features[projection]
    out_features = shapes.out_features[projection][FUSED_PROJECTIONS[projection].index(module)]
    if tuple(a_shape) != (rank, in_features) or tuple(b_shape) != (out_features, rank):
        raise LoRAAdapterError(
            f"LoRA module layers.{layer}.{module} has A {tuple(a_shape)} and B {tuple(b_shape)}; "
            f"this base model needs A ({rank}, {in_features}) and B ({out_features}, {rank})"
        )


def module_pairs(names_and_values, num_layers: int, path, parse) -> dict[tuple[int, str], dict[str, object]]:
    """(layer, module) -> {"A": value, "B": value} from (weight name, value) pairs; both required.
    ``parse(name, num_layers)`` gives a name's (layer, PEFT module, "A" or "B")."""
    pairs: dict[tuple[int, str], dict[str, object]] = {}
    for name, value in names_and_values:
        layer, module, kind = parse(name, num_layers)
        pairs.setdefault((layer, module), {})[kind] = value
    if not pairs:
        raise LoRAAdapterError(f"LoRA adapter {str(path)!r} has no weights")
    for (layer, module), pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise LoRAAdapterError(f"LoRA module layers.{layer}.{module} lacks lora_A or lora_B")
    return pairs
