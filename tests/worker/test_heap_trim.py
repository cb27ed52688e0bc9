"""The worker's idle heap trim gives freed-but-resident heap pages back (glibc)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from services.worker.heap_trim import _malloc_trim

# Freed holes inside the heap stay resident; only malloc_trim gives them back. The
# program frees a 4 MiB mapping first, which raises glibc's dynamic mmap threshold (as a
# forward pass's activations do), so the 1 MiB buffers after it come from the heap.
PROGRAM = textwrap.dedent("""
    import ctypes
    from services.worker.heap_trim import trim_heap

    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]

    def rss_mib():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024

    libc.free(libc.malloc(4 << 20))
    buffers = [libc.malloc(1 << 20) for _ in range(200)]
    for b in buffers:
        ctypes.memset(b, 1, 1 << 20)
    for b in buffers[:-1]:  # the last one pins the heap's top: no automatic trim
        libc.free(b)
    before = rss_mib()
    released = trim_heap()
    print(before, rss_mib(), released)
""")


@pytest.mark.skipif(_malloc_trim() is None, reason="not glibc: the worker's trim does nothing there")
def test_trim_returns_freed_heap_pages():
    out = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=60, check=True)
    before, after, released = out.stdout.split()
    assert released == "True"
    assert float(before) - float(after) > 150  # of the ~199 MiB freed into the heap
