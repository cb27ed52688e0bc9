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


def write_small_vocab_llama(folder: Path, seed: int = 0, vocab_size: int = 32, logit_scale: float = 1.0) -> Path:
    """A random tiny Llama over ``vocab_size`` word tokens ``t0 t1 ...`` (EOS ``t2``), small
    enough a vocabulary for a chi-square over its next-token distribution."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5,
        tie_word_embeddings=False, initializer_range=0.2, bos_token_id=0, eos_token_id=2, pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    model.save_pretrained(folder, safe_serialization=True)
    vocab = {f"t{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t1"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "t0", "eos_token": "t2", "unk_token": "t1", "pad_token": "t0"}))
    return folder
