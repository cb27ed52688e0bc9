"""The rotary embedding's cos/sin table for one base and scaling (Llama 3 and linear scaling
included), built once per model and kept in float32 whatever the model's dtype."""

from __future__ import annotations

import math

import torch

from kernels import KernelOps


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """The inverse frequencies, computed as Hugging Face computes them: on the CPU, whatever
    device is current (a model is built under ``torch.device(cuda)``)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    scaling = scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
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


class RotaryEmbedding:
    """``cos_sin_cache``: ``[max_positions, head_dim]`` float32 (see ``kernels.rotary``), on
    the device current at construction. Not a module buffer: a model's dtype change leaves
    it in float32."""

    def __init__(self, ops: KernelOps, head_dim: int, max_positions: int, theta: float,
                 scaling: dict | None = None) -> None:
        self.head_dim = head_dim
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        self.cos_sin_cache = ops.compute_cos_sin_cache(head_dim, max_positions, theta, inv_freq).to(
            torch.get_default_device())
