"""get_kernel_ops: backend selection, and the batch-invariant sets."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import get_kernel_ops
from kernels.paged_attention_torch import paged_attention_cpu, paged_attention_cpu_batch_invariant
from kernels.paged_attention import paged_attention_triton


def test_explicit_backends():
    assert get_kernel_ops("torch").name == "torch"
    assert get_kernel_ops("torch").paged_attention is paged_attention_cpu
    assert get_kernel_ops("triton").name == "triton"
    assert get_kernel_ops("triton").paged_attention is paged_attention_triton


def test_float32_hf_order_picks_the_float32_elementwise_kernels():
    from kernels.rms_norm import rms_norm_cpu, rms_norm_cpu_c
    from kernels.silu_and_mul import silu_and_mul_cpu, silu_and_mul_cpu_c

    exact, fast = get_kernel_ops("torch"), get_kernel_ops("torch", float32_hf_order=False)
    assert (exact.rms_norm, exact.silu_and_mul) == (rms_norm_cpu, silu_and_mul_cpu)
    assert (fast.rms_norm, fast.silu_and_mul) == (rms_norm_cpu_c, silu_and_mul_cpu_c)
    assert fast.paged_attention is exact.paged_attention and fast.name == "torch"
    assert get_kernel_ops("triton", float32_hf_order=False).name == "triton"


def test_batch_invariant_sets_take_the_per_token_attention():
    for hf_order in (True, False):
        ops = get_kernel_ops("torch", float32_hf_order=hf_order, batch_invariant=True)
        assert ops is get_kernel_ops("torch", float32_hf_order=hf_order, batch_invariant=True)
        assert ops.batch_invariant and ops.paged_attention is paged_attention_cpu_batch_invariant
        assert ops.rms_norm is get_kernel_ops("torch", float32_hf_order=hf_order).rms_norm
    assert not get_kernel_ops("torch").batch_invariant


@pytest.mark.cuda
def test_auto_follows_cuda():
    expected = "triton" if torch.cuda.is_available() else "torch"
    assert get_kernel_ops().name == expected
    assert get_kernel_ops("auto").name == expected


def test_unknown_backend_raises():
    with pytest.raises(ValueError, match="cuda"):
        get_kernel_ops("cuda")


def test_torch_backend_works_without_triton():
    # Triton ships for x86_64 only; elsewhere the PyTorch path must import and run.
    script = """
import sys
sys.modules["triton"] = None  # makes `import triton` raise ImportError
import torch
from kernels import get_kernel_ops
ops = get_kernel_ops("auto")
assert ops.name == "torch"
x = torch.randn(2, 8)
assert ops.rms_norm(x, torch.ones(8), 1e-6).shape == (2, 8)
try:
    get_kernel_ops("triton")
except ValueError:
    print("ok")
"""
    repo_root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=repo_root, capture_output=True, text=True, timeout=120
    )
    assert result.stdout.strip() == "ok", result.stderr
