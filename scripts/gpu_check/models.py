"""Random models of real shapes for the GPU check: no weights travel to the GPU machine.

Each model is built from its config on the device, its weights rounded to bfloat16 and
saved once (with a byte-level tokenizer of the model's vocabulary size) into the check's
scratch folder, where later steps find it. Both sides of every comparison load those saved
values: our engine from the folder, transformers from the folder or the model built.

The initialisation is transformers' with a standard deviation of 0.2 instead of 0.02:
at 0.02 the layers add little to the tied input embedding, and greedy decoding repeats the
last token (1 or 2 distinct tokens in 24); at 0.2 every generated token differed and the
top-2 logit gaps had a median of 0.78, none under 1e-3 (SmolLM2-135M's shape, 6 random
prompts, 144 positions, on the CPU).
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

INIT_STD = 0.2
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict | None = field(default=None, hash=False)
    tie_word_embeddings: bool = True

    @property
    def slug(self) -> str:
        return re.sub(r"[^a-z0-9]+", "-", self.name.lower()).strip("-")


SMOLLM2_135M = ModelShape("SmolLM2-135M", 576, 1536, 30, 9, 3, 64, 49152, 8192, 100000.0)
LLAMA_32_1B = ModelShape("Llama-3.2-1B", 2048, 8192, 16, 32, 8, 64, 128256, 131072, 500000.0, LLAMA3_SCALING)
# The dry run's stand-ins: the same kinds of model (GQA, tied embeddings, llama3 rope
# scaling), tiny.
SMOLLM2_TINY = ModelShape("SmolLM2-135M-like tiny", 96, 192, 2, 6, 2, 16, 320, 2048, 100000.0)
LLAMA_TINY = ModelShape("Llama-3.2-1B-like tiny", 128, 256, 2, 8, 2, 16, 352, 2048, 500000.0,
                        {**LLAMA3_SCALING, "original_max_position_embeddings": 256})


def smollm2(dry_run: bool) -> ModelShape:
    return SMOLLM2_TINY if dry_run else SMOLLM2_135M


def llama_1b(dry_run: bool) -> ModelShape:
    return LLAMA_TINY if dry_run else LLAMA_32_1B


def model_folder(shape: ModelShape, work: Path, device: str, want_model: bool = False):
    """(folder, the float32 transformers model on ``device`` or None): the saved model of
    ``shape`` in ``work``, built there first if no step has. ``want_model`` returns the model
    too (built, or loaded from the folder)."""
    import torch

    folder = work / "models" / shape.slug
    if (folder / "config.json").exists():
        return folder, load_hf(folder, torch.float32, device) if want_model else None
    from tests.hf_reference import make_random_llama

    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    _, model = make_random_llama(
        partial, seed=0, num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads, hidden_size=shape.hidden_size,
        head_dim=shape.head_dim, num_layers=shape.num_layers, intermediate_size=shape.intermediate_size,
        vocab_size=shape.vocab_size, max_position_embeddings=shape.max_position_embeddings,
        rope_theta=shape.rope_theta, rope_scaling=shape.rope_scaling, tie_word_embeddings=shape.tie_word_embeddings,
        init_std=INIT_STD, device=device, save_dtype=torch.bfloat16,
    )
    partial.rename(folder)  # a step stopped while saving leaves no half-written model behind
    if want_model:
        return folder, model
    del model
    return folder, None


def load_hf(folder: Path, dtype, device: str):
    """transformers' model of ``folder`` in ``dtype`` on ``device`` (eval)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).to(device).eval()


def random_prompts(vocab_size: int, lengths: list[int], seed: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]
