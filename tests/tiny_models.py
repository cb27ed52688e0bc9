"""Tiny random models of every architecture we serve, built with transformers from a config
and saved as complete Hugging Face folders (safetensors, config, byte-level tokenizer).

``make_tiny_model(arch, folder, **overrides)`` builds ``TINY_CONFIGS[arch]`` with the
overrides, spreads the weights as ``make_tiny_random_llama`` does (so greedy picks are
rarely near ties), jitters every norm weight (a mix-up of norms shows), and saves the
folder. Windows are shorter than the test prompts, so a sliding window matters.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tests.hf_reference import save_byte_level_tokenizer

VOCAB = 320
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=2048, rms_norm_eps=1e-5,
               initializer_range=0.2, bos_token_id=0, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)

# arch -> (config class, model class, config fields beyond _COMMON)
TINY_CONFIGS = {
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=24)),
    # Qwen2: layers from max_window_layers on slide (one full layer, two sliding).
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=24,
                                                    max_window_layers=1)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict()),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=24)),
    # Gemma 3: five sliding layers to each global one; the global layer last but one here.
    # Untied: a tiny random model reading its embedding as LM head repeats its input token
    # (the real Gemma 3 270M test covers the tied, scaled embedding).
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(num_hidden_layers=7, sliding_window=24, query_pre_attn_scalar=24,
                    rope_local_base_freq=10000.0, rope_theta=1000000.0)),
    # Mixtures of experts: 4 experts, 2 per token (Qwen3-MoE renormalising them, as Mixtral does).
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2,
                                                            sliding_window=24)),
}


def make_tiny_model(arch: str, folder: str | os.PathLike, seed: int = 0, lm_head_scale: float = 5.0,
                    **overrides) -> Path:
    import transformers

    config_cls, model_cls, fields = TINY_CONFIGS[arch]
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = getattr(transformers, config_cls)(**{**_COMMON, **fields, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                # Gemma's norms are zero-centred (1 + w); the others start at 1.
                centre = 0.0 if arch == "gemma3" else 1.0
                param.copy_(centre + 0.1 * torch.randn(param.shape, generator=gen))
            elif name.endswith(".bias"):
                param.copy_(0.2 * torch.randn(param.shape, generator=gen))
        if not config.tie_word_embeddings:
            model.lm_head.weight.mul_(lm_head_scale)
    model.save_pretrained(folder, safe_serialization=True)
    save_byte_level_tokenizer(folder, VOCAB)
    return folder
