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


# PEFT module -> llama.cpp's tensor name in a decoder block.
GGUF_TENSOR_OF = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
                  "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def write_gguf_lora(folder: str | Path, file: str | Path, *, num_heads: int, num_kv_heads: int,
                    architecture: str = "llama", tensor_type: str = "F32", alpha: float | None = None,
                    extra_metadata: dict | None = None) -> Path:
    """The PEFT adapter in ``folder`` written as llama.cpp's ``convert_lora_to_gguf.py`` writes
    it: ``blk.N.<tensor>.weight.lora_a`` = A ``[r, in]`` and ``.lora_b`` = B ``[out, r]``,
    B's q/k rows permuted for "llama" as its converter permutes the base weights (each
    head's two rotary halves interleaved), ``adapter.lora.alpha`` = PEFT's ``lora_alpha``
    (or ``alpha``), tensors in ``tensor_type`` (F32, F16, BF16 or Q8_0; as the converter,
    F16 where rows are too short for Q8_0's blocks of 32)."""
    import json

    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    folder, file = Path(folder), Path(file)
    config = json.loads((folder / "adapter_config.json").read_text())
    writer = gguf.GGUFWriter(str(file), architecture)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(config["lora_alpha"] if alpha is None else alpha))
    for key, value in (extra_metadata or {}).items():
        writer.add_string(key, value)
    qtype = gguf.GGMLQuantizationType[tensor_type]
    for name, value in sorted(load_file(str(folder / "adapter_model.safetensors")).items()):
        parts = name.split(".")
        layer, module, kind = parts[parts.index("layers") + 1], parts[-3], parts[-2]
        value = value.astype(np.float32)
        if kind == "lora_B" and architecture == "llama" and module in ("q_proj", "k_proj"):
            heads = num_heads if module == "q_proj" else num_kv_heads
            out, rank = value.shape
            value = value.reshape(heads, 2, out // heads // 2, rank).swapaxes(1, 2).reshape(out, rank)
        gguf_name = f"blk.{layer}.{GGUF_TENSOR_OF[module]}.weight.lora_{kind[-1].lower()}"
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, value)
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(gguf_name, value.astype(np.float16))
        else:
            try:
                writer.add_tensor(gguf_name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
            except gguf.QuantError:  # rows shorter than a Q8_0 block: the converter falls back to F16
                writer.add_tensor(gguf_name, value.astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return file
