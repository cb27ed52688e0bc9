"""A GGUF LoRA file (``shared/lora_gguf.py``) read into the same per-module A/B pairs a PEFT
folder gives, for ``adapter.py`` to lay out: dequantized to float32 by ``gguf.quants`` and,
for a "llama" file, B's q and k rows put back in Hugging Face order (the converter permuted
them as it permutes the base weights).

Runs in the workers' loader thread, so numpy only (see ``adapter.py``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from shared.lora_gguf import numpy_shape, read_gguf_lora
from shared.model_config import ModelConfig
from shared.model_files import unpermute_rows

# The architectures whose q/k rows llama.cpp's converters permute.
PERMUTED_ARCHITECTURES = ("llama",)


def _float32(tensor) -> np.ndarray:
    from gguf.quants import dequantize

    values = dequantize(tensor.data, tensor.tensor_type)
    # F32 comes back as a view of the read-only memory map: copy it.
    return np.array(values, dtype=np.float32).reshape(numpy_shape(tensor))


def read_gguf_pairs(path: str | Path, model_config: ModelConfig, max_rank: int):
    """``(rank, scaling, {(layer, module): {"A": [r, in], "B": [out, r]}})`` float32 numpy,
    checked as ``read_gguf_lora`` checks. Raises ``LoRAAdapterError``."""
    lora = read_gguf_lora(path, model_config, max_rank)
    heads = {}
    if lora.architecture in PERMUTED_ARCHITECTURES:
        heads = {"q_proj": model_config.num_attention_heads, "k_proj": model_config.num_key_value_heads}
    pairs = {}
    for (layer, module), pair in lora.pairs.items():
        a, b = _float32(pair["A"]), _float32(pair["B"])
        if module in heads:
            b = b[unpermute_rows(heads[module], b.shape[0])]
        pairs[(layer, module)] = {"A": a, "B": b}
    return lora.rank, lora.scaling, pairs
