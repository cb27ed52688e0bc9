"""Imports Triton where it is installed, and a stand-in where it is not.

Triton ships for x86_64 only, but the PyTorch references (the CPU path) live beside the
kernels in the same modules; with the stand-in those modules still import, and any launch
of a Triton kernel raises. Kernel modules take `triton` and `tl` from here.
"""

try:
    import triton
    import triton.language as tl
    from triton.runtime.errors import OutOfResources

    HAS_TRITON = True
except ImportError:
    import types

    HAS_TRITON = False

    class _MissingKernel:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            raise RuntimeError(f"{self.fn.__name__} needs Triton, which is not installed")

    triton = types.SimpleNamespace(jit=_MissingKernel)
    # Only what kernel signatures evaluate when they are defined.
    tl = types.SimpleNamespace(constexpr=object)

    class OutOfResources(Exception):
        """Triton's error for a launch the GPU cannot hold (never raised without Triton)."""

__all__ = ["HAS_TRITON", "OutOfResources", "tl", "triton"]
