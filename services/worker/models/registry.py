"""Architecture name (``shared.architectures``) -> the model class that runs it."""

from __future__ import annotations

from shared.architectures import ARCHITECTURES
from shared.config import ConfigError
from shared.model_config import ModelConfig

from .base import CausalLM
from .gemma3 import Gemma3ForCausalLM
from .llama import LlamaForCausalLM, Phi3ForCausalLM
from .moe import MixtralForCausalLM, Qwen3MoeForCausalLM

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "phi3": Phi3ForCausalLM,
    "gemma3": Gemma3ForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "mixtral": MixtralForCausalLM,
}


def model_class(config: ModelConfig) -> type[CausalLM]:
    """The class of ``config``'s architecture; ConfigError naming it when none runs it."""
    cls = MODEL_CLASSES.get(config.architecture)
    if cls is None:
        raise ConfigError(f"architecture {config.architecture!r} has no model class in this worker "
                          f"(served: {sorted(MODEL_CLASSES)}; described: {sorted(ARCHITECTURES)})")
    return cls
