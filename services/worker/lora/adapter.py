"""A PEFT LoRA adapter folder (``shared/lora.py``) or GGUF LoRA file (``gguf_adapter.py``)
read into A/B matrices laid out for our fused projections.

Our model fuses q/k/v into one projection and gate/up into another (``layers/linear.py``),
so an adapter is stored per layer and *fused* projection: the sub-modules' A matrices
stacked (each padded to ``max_rank`` rows) and their B matrices block-diagonal, with the
scaling folded into B. One shrink ``x @ A.T`` and one expand ``h @ B.T`` then give each
sub-module's delta in its own rows of the fused output; padding rows and absent
sub-modules are zeros, which add exactly nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shared.lora import WEIGHTS_FILE, lora_scaling, parse_weight_name, read_adapter_config
from shared.lora_shapes import (
    FUSED_PROJECTIONS,
    MODULE_TO_PROJECTION,
    LoRAAdapterError,
    ProjectionShapes,
    check_module_shapes,
    module_pairs,
)
from shared.model_config import ModelConfig

from .gguf_adapter import read_gguf_pairs


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


def _float32(tensor: torch.Tensor) -> np.ndarray:
    """The tensor as a float32 numpy array, converted by numpy (bfloat16 by its bits)."""
    if tensor.dtype == torch.bfloat16:
        return (tensor.view(torch.int16).numpy().astype(np.int32) << 16).view(np.float32)
    return tensor.numpy().astype(np.float32, copy=False)


def load_lora_adapter(name: str, path: str | Path, model_config: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Read and check the PEFT folder (or GGUF LoRA file) at ``path`` for a model of
    ``model_config``; raises ``LoRAAdapterError`` (bad path, rank above ``max_rank``, a shape
    or module the base model does not have). The weights are float32 on the host; the
    slots convert them.

    Runs in the workers' loader thread, so every computation here is numpy's: a torch op
    in a second thread would start a second OpenMP pool, which slows every op of the
    forward thread (see ``services/worker/service.py``)."""
    read = read_gguf_pairs if Path(path).is_file() else _read_peft_pairs
    rank, scaling, pairs = read(path, model_config, max_rank)
    shapes = ProjectionShapes.of(model_config)
    fused: list[dict[str, tuple[np.ndarray, np.ndarray]]] = [{} for _ in range(model_config.num_hidden_layers)]
    for (layer, module), pair in sorted(pairs.items()):
        projection = MODULE_TO_PROJECTION[module]
        sub = FUSED_PROJECTIONS[projection].index(module)
        outs = shapes.out_features[projection]
        if projection not in fused[layer]:
            stacked = shapes.stacked_rank(projection, max_rank)
            fused[layer][projection] = (np.zeros((stacked, shapes.in_features[projection]), np.float32),
                                        np.zeros((sum(outs), stacked), np.float32))
        fused_a, fused_b = fused[layer][projection]
        cols = slice(sub * max_rank, sub * max_rank + rank)
        rows = slice(sum(outs[:sub]), sum(outs[: sub + 1]))
        fused_a[cols] = pair["A"]
        fused_b[rows, cols] = pair["B"] * np.float32(scaling)
    weights = [{p: (torch.from_numpy(a), torch.from_numpy(b)) for p, (a, b) in layer.items()} for layer in fused]
    return LoRAAdapter(name=name, path=str(path), rank=rank, scaling=scaling, weights=weights)


def _read_peft_pairs(path: str | Path, model_config: ModelConfig, max_rank: int):
    """``(rank, scaling, {(layer, module): {"A": [r, in], "B": [out, r]}})`` float32 numpy
    from a PEFT folder, checked."""
    from safetensors import SafetensorError, safe_open

    config = read_adapter_config(path, max_rank)
    rank = config["r"]
    try:
        with safe_open(str(Path(path) / WEIGHTS_FILE), framework="pt") as f:
            tensors = {key: f.get_tensor(key) for key in f.keys()}
    except (OSError, SafetensorError) as e:
        raise LoRAAdapterError(f"cannot read {WEIGHTS_FILE} of {str(path)!r}: {e}") from None
    shapes = ProjectionShapes.of(model_config)
    pairs = module_pairs(tensors.items(), model_config.num_hidden_layers, path, parse_weight_name)
    for (layer, module), pair in pairs.items():
        check_module_shapes(layer, module, pair["A"].shape, pair["B"].shape, rank, shapes)
    return rank, lora_scaling(config), {key: {k: _float32(t) for k, t in pair.items()} for key, pair in pairs.items()}
