"""The model's dtype from ``--dtype``: what ``auto`` picks on this machine, and why.

On CUDA ``auto`` is bfloat16. On a CPU it is bfloat16 where both hold: the CPU
multiplies bf16 pairs natively (``shared.cpu_features.native_bf16_dot``), and oneDNN
can prepack a bf16 weight and multiply with it (a tiny probe at start-up). Without
either, products of bf16 float weights are widened to float32 on every call and run
several times slower than float32 (docs/BENCHMARKS.md, /work/shared/CPU-NOTES.md), so
``auto`` is float32 there, unless the weights stay quantized: their products quantize
the activations to int8 whatever the rows' dtype, and bfloat16 rows (half the bytes, and
the one-token path, ``kernels/decode_layers.py``) served the default model 1.64x faster at
concurrency 1 and 1.23x at 32 than float32 on an AVX2-only CPU (docs/BENCHMARKS-diary.md,
"A real AVX2-only CPU"). The decision and its reason are logged; an explicit ``bfloat16``
of float weights on a CPU without native bf16 dot products runs as asked, with a warning.

The KV cache's dtype from ``--kv-cache-dtype``: ``auto`` is the model's dtype, as in vLLM
(so a quantized model's cache is bfloat16 on every CPU, and ``--quantization none`` keeps
float32 weights and cache, which match Hugging Face bit for bit). bfloat16 under a float32
model runs on CPU only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from shared.config import ConfigError
from shared.cpu_features import cpu_flags, describe, native_bf16_dot

from .linear import can_prepack, prepacked_linear

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def bf16_prepack_works() -> bool:
    """Whether oneDNN prepacks a small bf16 weight and its product matches float32's
    (within bf16 rounding)."""
    if not can_prepack(torch.device("cpu"), torch.bfloat16):
        return False
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 64, generator=gen).bfloat16()
    x = torch.randn(3, 64, generator=gen).bfloat16()
    try:
        got = prepacked_linear(weight)(x)
    except RuntimeError:
        return False
    expected = x.float() @ weight.float().T
    return got.dtype == torch.bfloat16 and torch.allclose(got.float(), expected, rtol=2e-2, atol=5e-2)


def resolve_dtype(
    name: str,
    device: torch.device,
    flags: frozenset[str] | None = None,
    prepack_works: Callable[[], bool] = bf16_prepack_works,
    keep_quantized: bool = False,
) -> torch.dtype:
    """The dtype ``name`` (auto|float32|bfloat16|float16) means on ``device``; ``flags``
    are the CPU's (default: this machine's); ``keep_quantized``: whether the weights stay
    quantized (their products take int8 activations)."""
    if device.type != "cpu":
        return torch.bfloat16 if name == "auto" else DTYPES[name]
    if name not in ("auto", "bfloat16"):
        return DTYPES[name]
    flags = cpu_flags() if flags is None else flags
    native = native_bf16_dot(flags)
    if name == "bfloat16":
        if not native and not keep_quantized:
            logger.warning(
                "--dtype bfloat16 on a CPU without native bf16 dot products (flags: %s): every product "
                "widens bf16 to float32, several times slower than --dtype float32 at larger batches",
                describe(flags),
            )
        return torch.bfloat16
    if native and prepack_works():
        logger.info("dtype auto -> bfloat16: the CPU has native bf16 dot products (flags: %s) and oneDNN "
                    "prepacks bf16 weights", describe(flags))
        return torch.bfloat16
    why = (f"the CPU has native bf16 dot products (flags: {describe(flags)}), but oneDNN cannot prepack bf16 "
           "weights in this torch build" if native else
           f"the CPU has no native bf16 dot products (flags: {describe(flags)})")
    if keep_quantized:
        logger.info("dtype auto -> bfloat16: %s; the weights stay quantized and their products take int8 "
                    "activations", why)
        return torch.bfloat16
    logger.info("dtype auto -> float32: %s", why)
    return torch.float32


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache dtype ``name`` (auto|bfloat16|float32) means for a ``model_dtype`` model
    on ``device``; raises ConfigError for a pairing the kernels do not run."""
    if name == "auto":
        return model_dtype
    cache_dtype = DTYPES[name]
    if cache_dtype == model_dtype or (
        device.type == "cpu" and model_dtype == torch.float32 and cache_dtype == torch.bfloat16
    ):
        return cache_dtype
    raise ConfigError(f"kv_cache_dtype {name} with a {str(model_dtype).removeprefix('torch.')} model on "
                     f"{device.type}: the cache takes the model's dtype, or bfloat16 under a float32 model on CPU")
