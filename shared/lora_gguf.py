"""GGUF LoRA adapters (the files llama.cpp's ``convert_lora_to_gguf.py`` writes) checked
against a base model, without torch.

Such a file says ``general.type = "adapter"``, ``adapter.type = "lora"`` and
``adapter.lora.alpha``, and holds, per adapted module, the base GGUF's tensor name plus
``.lora_a`` (PEFT's A, ``[r, in]``) and ``.lora_b`` (PEFT's B, ``[out, r]``), e.g.
``blk.3.attn_q.weight.lora_a``; ggml lists dims innermost first, so its header says
``[in, r]`` and ``[r, out]``. The scaling is llama.cpp's: ``alpha / r``, or 1 where alpha
is 0 or absent (the format has no rsLoRA: the converter writes PEFT's ``lora_alpha`` as is).
For ``general.architecture = "llama"`` the converter permutes B's q and k rows as it does
the base weights' (rotary halves interleaved); the workers undo that
(``services/worker/lora/gguf_adapter.py``).

``read_gguf_lora`` reads the header only (the tensors are memory-mapped, not read) and
refuses what a PEFT folder is refused for: a shape the base model lacks, a rank above
``--max-lora-rank``, a module we do not serve; and a GGUF that is no LoRA adapter, or one
made for another architecture.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.lora_shapes import (
    LoRAAdapterError,
    ProjectionShapes,
    check_module_shapes,
    module_pairs,
)
from shared.model_config import ModelConfig, gguf_value

MAGIC = b"GGUF"
# llama.cpp's tensor name of each module (after "blk.N.") -> the PEFT module it is.
GGUF_MODULES = {
    "attn_q": "q_proj",
    "attn_k": "k_proj",
    "attn_v": "v_proj",
    "attn_output": "o_proj",
    "ffn_gate": "gate_proj",
    "ffn_up": "up_proj",
    "ffn_down": "down_proj",
}
# Our architecture -> the general.architecture llama.cpp writes for it (Mistral as "llama"),
# for the families whose GGUF LoRA files we read (their projections as llama.cpp names them).
GGUF_ARCHITECTURE = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3"}
# The types convert_lora_to_gguf.py writes (--outtype f32, f16, bf16, q8_0).
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0")
ALORA_KEY = "adapter.alora.invocation_tokens"
_TENSOR_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.weight\.lora_([ab])$")


@dataclass
class GGUFLoRA:
    """A checked GGUF LoRA: ``pairs[(layer, PEFT module)] = {"A": tensor, "B": tensor}``, the
    ``gguf.ReaderTensor`` of each (data memory-mapped)."""

    architecture: str
    rank: int
    scaling: float
    pairs: dict[tuple[int, str], dict[str, Any]]


def numpy_shape(tensor) -> tuple[int, ...]:
    """A reader tensor's shape outermost first (as numpy and PEFT write it)."""
    return tuple(int(n) for n in reversed(tensor.shape))


def parse_tensor_name(name: str, num_layers: int) -> tuple[int, str, str]:
    """``blk.3.attn_q.weight.lora_a`` -> (3, "q_proj", "A")."""
    m = _TENSOR_NAME.match(name)
    if m is None:
        if name.endswith("_norm.weight"):
            raise LoRAAdapterError(f"GGUF LoRA tensor {name!r}: norm weights in an adapter are not supported")
        if name.endswith((".lora_a", ".lora_b")) and not name.startswith("blk."):
            raise LoRAAdapterError(f"GGUF LoRA tensor {name!r} is not in a decoder layer")
        raise LoRAAdapterError(f"GGUF LoRA tensor {name!r} is not a lora_a / lora_b tensor")
    layer, kind = int(m.group(1)), m.group(3).upper()
    module = GGUF_MODULES.get(m.group(2))
    if module is None:
        raise LoRAAdapterError(f"GGUF LoRA target tensor {m.group(2)!r} is not supported "
                               f"(supported: {', '.join(GGUF_MODULES)})")
    if layer >= num_layers:
        raise LoRAAdapterError(f"GGUF LoRA tensor {name!r}: the base model has {num_layers} layers")
    return layer, module, kind


def _open(path: str | Path):
    from shared.gguf_reader import GGUFFile

    try:
        with open(path, "rb") as f:
            magic = f.read(len(MAGIC))
    except OSError as e:
        raise LoRAAdapterError(f"cannot read LoRA adapter file {str(path)!r}: {e}") from None
    if magic != MAGIC:
        raise LoRAAdapterError(f"LoRA adapter file {str(path)!r} is not a GGUF file "
                               f"(a PEFT adapter is a folder)")
    try:
        return GGUFFile(path)
    except (OSError, ValueError, IndexError, KeyError, struct.error, UnicodeDecodeError) as e:
        raise LoRAAdapterError(f"cannot read GGUF file {str(path)!r}: {e}") from None


def _check_metadata(reader, path, model_config: ModelConfig) -> str:
    """The file's architecture, once it is known to be a LoRA adapter for the base model."""
    general_type = gguf_value(reader, "general.type", None)
    if general_type != "adapter":
        raise LoRAAdapterError(f"GGUF file {str(path)!r} is not a LoRA adapter: general.type is "
                               f"{general_type!r}, not 'adapter'")
    adapter_type = gguf_value(reader, "adapter.type", None)
    if adapter_type != "lora":
        raise LoRAAdapterError(f"GGUF adapter {str(path)!r} has adapter.type {adapter_type!r}, not 'lora'")
    if ALORA_KEY in reader.fields:
        raise LoRAAdapterError("activated LoRA (aLoRA) adapters are not supported")
    architecture = gguf_value(reader, "general.architecture", None)
    wanted = GGUF_ARCHITECTURE.get(model_config.architecture)
    if wanted is None:
        raise LoRAAdapterError(f"GGUF LoRA adapters for {model_config.architecture!r} models are not supported")
    if architecture != wanted:
        raise LoRAAdapterError(f"GGUF LoRA {str(path)!r} is for architecture {architecture!r}; "
                               f"the base model is {wanted!r}")
    return architecture


def read_gguf_lora(path: str | Path, model_config: ModelConfig, max_rank: int) -> GGUFLoRA:
    """Check the GGUF LoRA file at ``path`` for a model of ``model_config`` from its header.
    Raises ``LoRAAdapterError``."""
    reader = _open(path)
    architecture = _check_metadata(reader, path, model_config)
    alpha = gguf_value(reader, "adapter.lora.alpha", 0.0)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoRAAdapterError(f"GGUF LoRA adapter.lora.alpha must be a number, got {alpha!r}")
    tensors = ((t.name, t) for t in reader.tensors)
    pairs = module_pairs(tensors, model_config.num_hidden_layers, path, parse=parse_tensor_name)
    ranks = sorted({numpy_shape(pair["B"])[-1] for pair in pairs.values()})
    if len(ranks) > 1:
        raise LoRAAdapterError(f"GGUF LoRA modules of different ranks {ranks} are not supported")
    rank = ranks[0]
    if rank < 1:
        raise LoRAAdapterError(f"GGUF LoRA rank must be positive, got {rank}")
    if rank > max_rank:
        raise LoRAAdapterError(f"LoRA rank {rank} is greater than max_lora_rank {max_rank}")
    shapes = ProjectionShapes.of(model_config)
    for (layer, module), pair in sorted(pairs.items()):
        for tensor in pair.values():
            if tensor.tensor_type.name not in TENSOR_TYPES:
                raise LoRAAdapterError(f"GGUF LoRA tensor {tensor.name!r} is {tensor.tensor_type.name}; "
                                       f"supported: {', '.join(TENSOR_TYPES)}")
        check_module_shapes(layer, module, numpy_shape(pair["A"]), numpy_shape(pair["B"]), rank, shapes)
    return GGUFLoRA(architecture=architecture, rank=rank, scaling=alpha / rank if alpha else 1.0, pairs=pairs)
