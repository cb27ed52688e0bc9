"""Kernel tests run the Triton kernels on CUDA, or on CPU under Triton's interpreter.

triton.jit reads TRITON_INTERPRET when a kernel is decorated, so it must be set before the
first import of `kernels`; conftest runs before the test modules of this folder import it.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# Imported only now: `kernels` must see TRITON_INTERPRET set above.
import pytest  # noqa: E402

from kernels import cpu_build  # noqa: E402
from shared.cpu_features import cpu_flags  # noqa: E402


def _host_isas() -> list[str]:
    """The NATSLLM_CPU_ISA builds this host can run: "avx2" (AVX-512 off) where it has AVX2
    and FMA, "native" where that is wider (AVX-512)."""
    flags = cpu_flags()
    isas = ["avx2"] if {"avx2", "fma"} <= flags else []
    if "avx512f" in flags or not isas:
        isas.append("native")
    return isas


@pytest.fixture(params=_host_isas())
def cpu_isa(request, monkeypatch):
    """The C kernels built and loaded for one instruction set (each test taking this runs
    once per build this host can run); yields the NATSLLM_CPU_ISA value."""
    monkeypatch.setenv("NATSLLM_CPU_ISA", request.param)
    cpu_build.forget_libraries()
    yield request.param
    cpu_build.forget_libraries()
