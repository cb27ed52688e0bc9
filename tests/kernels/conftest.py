"""Kernel tests run the Triton kernels on CUDA, or on CPU under Triton's interpreter.

triton.jit reads TRITON_INTERPRET when a kernel is decorated, so it must be set before the
first import of `kernels`; conftest runs before the test modules of this folder import it.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
