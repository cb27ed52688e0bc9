"""LoRA adapters made with ``peft`` for tests, and Hugging Face + PEFT as their reference.

``make_peft_adapter`` builds a PEFT LoRA on a copy of a Hugging Face model with random,
non-zero A and B (PEFT starts B at zero, which would test nothing) and saves the folder
(``adapter_config.json`` + ``adapter_model.safetensors``) as PEFT writes it.
``hf_with_adapter`` is a copy of the base model with that folder loaded by PEFT.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch


def make_peft_adapter(hf_model, folder: str | Path, *, rank: int, alpha: float, targets: list[str],
                      use_rslora: bool = False, seed: int = 0, b_std: float = 0.02) -> Path:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=use_rslora,
                        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    peft_model = get_peft_model(copy.deepcopy(hf_model), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name:
                param.copy_(torch.randn(param.shape, generator=gen) / param.shape[1] ** 0.5)
            elif "lora_B" in name:
                param.copy_(b_std * torch.randn(param.shape, generator=gen))
    folder = Path(folder)
    peft_model.save_pretrained(folder)
    return folder


def hf_with_adapter(hf_model, folder: str | Path):
    """A copy of ``hf_model`` with the PEFT adapter in ``folder`` (eval)."""
    from peft import PeftModel

    return PeftModel.from_pretrained(copy.deepcopy(hf_model), str(folder)).eval()
