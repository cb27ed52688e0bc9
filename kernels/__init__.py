"""The kernels layer: one set of operations the model calls, from Triton or from PyTorch.

`get_kernel_ops(backend)` is chosen once when a worker builds its model: "triton" runs the
Triton kernels (CUDA), "torch" the CPU path (C kernels for decode attention, the KV write,
RMSNorm, the rotary embedding (alone, or fused with the KV write) and SiLU-and-mul where
one can be built, see
`kernels.cpu_build`; otherwise the PyTorch references or leaner PyTorch variants of them),
"auto" picks Triton when CUDA (and Triton) is available. The torch backend's float32 RMSNorm
and SiLU-and-mul run Hugging Face's operations in Hugging Face's order (bit-for-bit greedy
parity) unless `float32_hf_order=False`, which takes their C kernels (for quantized weights,
whose results differ from Hugging Face's anyway). With `batch_invariant` (the default) the
torch backend's attention takes every query token alone (`paged_attention_cpu_batch_invariant`):
with its per-row C kernels and the quantized products (each row alone, in one fixed order)
a token's result does not depend on the batch; the Triton backend has no such mode yet.
Both backends take and return the
same tensors; see each kernel's module for shapes and layouts. Attention reads the step's
`AttentionMetadata`, which the model runner builds once per step.
"""

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from kernels.attention_metadata import AttentionMetadata
from kernels.fused_moe import fused_moe_ref, fused_moe_triton
from kernels.gelu_and_mul import gelu_tanh_and_mul_ref, gelu_tanh_and_mul_triton
from kernels.paged_attention import paged_attention_triton
from kernels.paged_attention_torch import paged_attention_cpu, paged_attention_cpu_batch_invariant
from kernels.rms_norm import rms_norm_cpu, rms_norm_cpu_c, rms_norm_triton
from kernels.rotary import compute_cos_sin_cache, rotary_embedding_cpu, rotary_embedding_triton
from kernels.rotary_write_kv import rotary_write_kv_cpu, rotary_write_kv_triton
from kernels.silu_and_mul import silu_and_mul_cpu, silu_and_mul_cpu_c, silu_and_mul_triton
from kernels.triton_import import HAS_TRITON
from kernels.write_kv import write_kv_cpu, write_kv_triton

BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class KernelOps:
    """The model's kernels from one backend; every callable has the same signature in both."""

    name: str
    rms_norm: Callable
    compute_cos_sin_cache: Callable  # the rotary embedding's table, built once per model
    rotary_embedding: Callable
    silu_and_mul: Callable
    gelu_tanh_and_mul: Callable  # Gemma's gated activation
    write_kv: Callable
    rotary_write_kv: Callable  # rotary_embedding, then write_kv of k and v, in one call
    paged_attention: Callable
    fused_moe: Callable  # a mixture-of-experts MLP's experts (kernels.fused_moe)
    # The products' kernels are chosen so that a row's result does not depend on the row
    # count either (services/worker/linear.py reads it when the model is built).
    batch_invariant: bool = False


TORCH_OPS = KernelOps(
    name="torch",
    rms_norm=rms_norm_cpu,
    compute_cos_sin_cache=compute_cos_sin_cache,
    rotary_embedding=rotary_embedding_cpu,
    silu_and_mul=silu_and_mul_cpu,
    gelu_tanh_and_mul=gelu_tanh_and_mul_ref,
    write_kv=write_kv_cpu,
    rotary_write_kv=rotary_write_kv_cpu,
    paged_attention=paged_attention_cpu,
    fused_moe=fused_moe_ref,
)

# The same, float32 included in the C kernels.
TORCH_C_FLOAT32_OPS = replace(TORCH_OPS, rms_norm=rms_norm_cpu_c, silu_and_mul=silu_and_mul_cpu_c)


def _batch_invariant(ops: KernelOps) -> KernelOps:
    return replace(ops, name=f"{ops.name}, batch invariant", paged_attention=paged_attention_cpu_batch_invariant,
                   batch_invariant=True)


# The torch backend's sets by (float32_hf_order, batch_invariant).
_TORCH_SETS = {
    (True, False): TORCH_OPS,
    (False, False): TORCH_C_FLOAT32_OPS,
    (True, True): _batch_invariant(TORCH_OPS),
    (False, True): _batch_invariant(TORCH_C_FLOAT32_OPS),
}

TRITON_OPS = KernelOps(
    name="triton",
    rms_norm=rms_norm_triton,
    compute_cos_sin_cache=compute_cos_sin_cache,
    rotary_embedding=rotary_embedding_triton,
    silu_and_mul=silu_and_mul_triton,
    gelu_tanh_and_mul=gelu_tanh_and_mul_triton,
    write_kv=write_kv_triton,
    rotary_write_kv=rotary_write_kv_triton,
    paged_attention=paged_attention_triton,
    fused_moe=fused_moe_triton,
)


def get_kernel_ops(backend: str = "auto", float32_hf_order: bool = True, batch_invariant: bool = False) -> KernelOps:
    """The kernel set for backend "torch", "triton" or "auto" (Triton iff CUDA is available);
    `float32_hf_order` and `batch_invariant` as the module says (the torch backend only)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; expected one of {BACKENDS}")
    if backend == "auto":
        backend = "triton" if torch.cuda.is_available() and HAS_TRITON else "torch"
    if backend == "triton" and not HAS_TRITON:
        raise ValueError("kernel backend 'triton' needs Triton, which is not installed")
    if backend == "triton":
        return TRITON_OPS
    return _TORCH_SETS[bool(float32_hf_order), bool(batch_invariant)]


__all__ = ["BACKENDS", "AttentionMetadata", "KernelOps", "get_kernel_ops"]
