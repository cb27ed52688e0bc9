"""Draft models for the speculative-decoding tests, written from a model the tests have.

``write_draft_model`` saves a Hugging Face folder that keeps a model's tokenizer,
embedding, final norm and LM head but only some of its layers (optionally with noise on
the kept weights): a cheaper, worse model of the same vocabulary, whose drafts the target
accepts often but not always.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from shared.model_files import load_model_config, open_weights
from shared.tokenizer import load_tokenizer


def write_draft_model(source: str, folder: Path, layers: list[int], noise: float = 0.0, seed: int = 0) -> Path:
    """A folder with ``source``'s layers ``layers`` (renumbered from 0), fp32 safetensors,
    every weight matrix perturbed by ``noise`` times its own standard deviation."""
    from safetensors.torch import save_file

    cfg = load_model_config(source)
    folder.mkdir(parents=True, exist_ok=True)
    renumber = {f"model.layers.{old}.": f"model.layers.{new}." for new, old in enumerate(layers)}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    with open_weights(source) as weights:
        for name in weights.names():
            if name.startswith("model.layers."):
                prefix = ".".join(name.split(".")[:3]) + "."
                if prefix not in renumber:
                    continue
                tensor = weights.load(name)
                name = renumber[prefix] + name[len(prefix):]
                if noise and tensor.dim() == 2:
                    tensor = tensor + noise * tensor.std() * torch.randn(tensor.shape, generator=generator)
            else:
                tensor = weights.load(name)
            tensors[name] = tensor.contiguous()
    save_file(tensors, str(folder / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": len(layers),
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": "silu",
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_ids[0] if cfg.eos_token_ids else None,
        "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer = load_tokenizer(source)
    tokenizer.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token, "unk_token": tokenizer.unk_token,
        "pad_token": tokenizer.pad_token, "chat_template": tokenizer.chat_template,
    }, indent=2))
    return folder
