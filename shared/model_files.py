"""Where the model's files are, and its weights under Hugging Face names.

``iter_weights(path)`` yields ``(hf_name, tensor)`` one tensor at a time, from a GGUF
file (dequantized on the fly, llama.cpp's Q/K row permutation undone) or from a
Hugging Face folder of (possibly sharded) safetensors read lazily. ``open_weights``
gives the same per-tensor access plus ``load_slice``, so a tensor-parallel rank can
read just its rows or columns of a tensor without materialising the rest.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from shared.gguf_quants import QuantizedTensor, dequantize, quantized_from_gguf
from shared.architectures import ARCHITECTURES
from shared.model_config import (  # noqa: F401  (load_model_config, ModelConfig: re-exported)
    default_model_path,
    ModelConfig,
    gguf_value,
    hf_ties_word_embeddings,
    load_model_config,
    open_gguf,
    read_json,
    resolve_model_path,
)

logger = logging.getLogger(__name__)

def iter_weights(path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, tensor)`` for every weight of the model, one tensor in memory at a time."""
    with open_weights(path) as weights:
        for name in weights.names():
            yield name, weights.load(name, dtype)


def open_weights(path: str | os.PathLike) -> "WeightSource":
    """Per-tensor access to a model's weights; use as a context manager."""
    kind, p = resolve_model_path(path)
    return GGUFWeights(p) if kind == "gguf" else SafetensorsWeights(p)


class WeightSource:
    """Weights under Hugging Face names: ``names``, ``shape``, ``load`` and ``load_slice``."""

    def names(self) -> list[str]:
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def load(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        raise NotImplementedError

    def load_slice(
        self, name: str, dim: int, start: int, stop: int, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """``load(name)`` narrowed to ``[start, stop)`` along ``dim`` (0: rows, 1: columns)."""
        raise NotImplementedError

    def load_quantized(self, name: str) -> QuantizedTensor | None:
        """The whole tensor kept quantized (``shared.gguf_quants``), or None where it is
        stored as float or in a quantization the worker does not keep."""
        return None

    def close(self) -> None:
        pass

    def __enter__(self) -> "WeightSource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --------------------------------------------------------------------------- GGUF

_GGUF_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Not weights of the HF model: llama.cpp's rope divisors are read into ModelConfig.rope_scaling.
_GGUF_SKIP = {"rope_freqs.weight"}
_BLK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def gguf_to_hf_name(name: str, architecture: str = "llama") -> str | None:
    """The Hugging Face name of a llama.cpp tensor of a model of ``architecture``; None for
    tensors HF does not have."""
    if name in _GGUF_SKIP:
        return None
    if name in _GGUF_TOP_NAMES:
        return _GGUF_TOP_NAMES[name]
    layer_names = ARCHITECTURES[architecture].gguf_tensor_names()
    m = _BLK.match(name)
    if m is None or m.group(2) not in layer_names:
        raise ValueError(f"GGUF tensor {name!r} has no Hugging Face counterpart in a {architecture} model")
    return f"model.layers.{m.group(1)}.{layer_names[m.group(2)]}.{m.group(3)}"


def unpermute_rows(num_heads: int, rows: int) -> np.ndarray:
    """Index map undoing llama.cpp's rotary permutation: ``hf_rows = gguf_rows[index]``.

    convert_hf_to_gguf.py interleaves each head's two rotary halves
    (reshape [heads, 2, d/2] -> swap -> [heads, d/2, 2]); HF row ``h*d + p*d/2 + i``
    is GGUF row ``h*d + 2*i + p``.
    """
    head_dim = rows // num_heads
    return np.arange(rows).reshape(num_heads, head_dim // 2, 2).transpose(0, 2, 1).reshape(-1)


class GGUFWeights(WeightSource):
    """A GGUF file's tensors, dequantized one at a time (``shared.gguf_quants.dequantize``
    where it knows the type, else ``gguf.quants.dequantize``: the same values).

    Every tensor is given under its Hugging Face name and with HF's values: llama.cpp's
    Q/K row permutation undone ("llama" files), and the 1 it adds to zero-centred norm
    weights taken off again (Gemma). A mixture-of-experts file's 3-D stack of one projection
    of every expert is given as HF's one tensor per expert."""

    def __init__(self, path: Path) -> None:
        import gguf.quants

        self._dequantize = gguf.quants.dequantize
        reader = open_gguf(path)
        gguf_arch = gguf_value(reader, "general.architecture")
        self.architecture = ARCHITECTURES[load_model_config(path).architecture]
        heads = int(gguf_value(reader, f"{gguf_arch}.attention.head_count"))
        kv_heads = int(gguf_value(reader, f"{gguf_arch}.attention.head_count_kv", heads))
        # llama.cpp permutes Q/K rows only for the "llama" arch (its rotary is interleaved);
        # the others use NeoX-style rotary and are stored as in HF.
        permute = {"attn_q": heads, "attn_k": kv_heads} if self.architecture.gguf_permutes_qk else {}
        # HF name -> (tensor, rows to unpermute by (heads), expert of a 3-D stack)
        self._tensors: dict[str, tuple[object, int | None, int | None]] = {}
        for t in reader.tensors:
            hf_name = gguf_to_hf_name(t.name, self.architecture.name)
            if hf_name is None:
                continue
            m = _BLK.match(t.name)
            if "{e}" in hf_name:  # a stack of experts: one HF tensor per expert
                for e in range(int(t.shape[-1])):
                    self._tensors[hf_name.format(e=e)] = (t, None, e)
                continue
            self._tensors[hf_name] = (t, permute.get(m.group(2)) if m else None, None)

    def names(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        t, _, expert = self._tensors[name]
        shape = tuple(int(n) for n in reversed(t.shape))  # ggml lists dims innermost first
        return shape if expert is None else shape[1:]

    def load(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.load_slice(name, 0, 0, self.shape(name)[0], dtype)

    def _offset_norm(self, name: str) -> bool:
        return self.architecture.gguf_norms_offset and name.endswith("norm.weight")

    def load_quantized(self, name: str) -> QuantizedTensor | None:
        t, heads, expert = self._tensors[name]
        shape = self.shape(name)
        if len(shape) != 2 or expert is not None:  # experts are kept float
            return None
        data = t.data if heads is None else t.data[unpermute_rows(heads, shape[0])]
        return quantized_from_gguf(np.asarray(data), t.tensor_type.name, shape[1])

    def load_slice(
        self, name: str, dim: int, start: int, stop: int, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        t, heads, expert = self._tensors[name]
        shape = self.shape(name)
        tensor_data = t.data if expert is None else t.data[expert]
        # Quantized blocks run along a row, so rows can be picked before dequantizing.
        if heads is not None:
            rows = unpermute_rows(heads, shape[0])
            data = tensor_data[rows[start:stop] if dim == 0 else rows]
        elif dim == 0:
            data = tensor_data[start:stop]
        else:
            data = tensor_data
        out = dequantize(np.asarray(data), t.tensor_type.name, shape[1]) if len(shape) == 2 else None
        if out is None:
            values = self._dequantize(data, t.tensor_type)
            # F32 tensors come back as a view of the read-only memory map: copy them.
            values = np.require(values, dtype=np.float32, requirements=["C", "O", "W"])
            out = torch.from_numpy(values)
        out = out.reshape(data.shape[0], *shape[1:])
        if dim != 0:
            out = out.narrow(dim, start, stop - start).contiguous()
        if self._offset_norm(name):
            out -= 1
        return out.to(dtype)


# --------------------------------------------------------------------------- safetensors

# Buffers some checkpoints carry that are not weights.
_SAFETENSORS_SKIP = re.compile(r"\.rotary_emb\.inv_freq$")


class SafetensorsWeights(WeightSource):
    """A Hugging Face folder's safetensors (single or sharded), read lazily with ``safe_open``."""

    def __init__(self, folder: Path) -> None:
        from safetensors import safe_open

        index = read_json(folder / "model.safetensors.index.json")
        if index is not None:
            files = sorted(set(index["weight_map"].values()))
        else:
            files = sorted(p.name for p in folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{folder} holds no *.safetensors files")
        tied = hf_ties_word_embeddings(read_json(folder / "config.json") or {})
        self._handles = [safe_open(str(folder / f), framework="pt") for f in files]
        self._where: dict[str, object] = {}
        for handle in self._handles:
            for name in handle.keys():
                if _SAFETENSORS_SKIP.search(name) or (tied and name == "lm_head.weight"):
                    continue
                self._where[name] = handle

    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._where[name].get_slice(name).get_shape())

    def load(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self._where[name].get_tensor(name).to(dtype)

    def load_slice(
        self, name: str, dim: int, start: int, stop: int, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        view = self._where[name].get_slice(name)
        index = (slice(None),) * dim + (slice(start, stop),)
        return view[index].to(dtype)

    def close(self) -> None:
        self._handles.clear()
        self._where.clear()
