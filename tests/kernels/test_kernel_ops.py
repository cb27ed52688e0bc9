"""get_kernel_ops: backend selection."""

import pytest
import torch

from kernels import get_kernel_ops
from kernels.paged_attention import paged_attention_ref, paged_attention_triton


def test_explicit_backends():
    assert get_kernel_ops("torch").name == "torch"
    assert get_kernel_ops("torch").paged_attention is paged_attention_ref
    assert get_kernel_ops("triton").name == "triton"
    assert get_kernel_ops("triton").paged_attention is paged_attention_triton


def test_auto_follows_cuda():
    expected = "triton" if torch.cuda.is_available() else "torch"
    assert get_kernel_ops().name == expected
    assert get_kernel_ops("auto").name == expected


def test_unknown_backend_raises():
    with pytest.raises(ValueError, match="cuda"):
        get_kernel_ops("cuda")
