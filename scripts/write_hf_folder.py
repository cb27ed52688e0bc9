"""Write a Hugging Face model folder (safetensors, config, tokenizer) from a GGUF file.

Peers that cannot read GGUF themselves (vLLM's CPU backend) serve the same weights from
such a folder: transformers dequantizes the GGUF, and the state dict is written with
safetensors directly, because ``save_pretrained`` refuses a model loaded from GGUF.

    python scripts/write_hf_folder.py OUT_DIR [--gguf PATH]   (default: the shipped model)

Nothing is written when OUT_DIR already holds a ``model.safetensors``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write_hf_folder(gguf_path: Path, out_dir: Path) -> Path:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                 dtype=torch.float32)
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # A config read from GGUF names no class; vLLM would guess one (Gemma 3: an embedding model).
    config.architectures = [type(model).__name__]
    config.save_pretrained(str(out_dir))
    model.generation_config.save_pretrained(str(out_dir))
    AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name).save_pretrained(str(out_dir))
    return out_dir


def main(argv: list[str] | None = None) -> int:
    from shared.model_config import default_model_path

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--gguf", type=Path, default=None, help="GGUF file (default: the shipped model)")
    args = parser.parse_args(argv)
    if (args.out_dir / "model.safetensors").exists():
        print(f"{args.out_dir} already written")
        return 0
    gguf = args.gguf or Path(default_model_path())
    print(f"wrote {write_hf_folder(gguf, args.out_dir)} from {gguf}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
