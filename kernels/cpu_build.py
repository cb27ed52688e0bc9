"""Building the CPU kernels written in C (`kernels/cpu/*.c`) and loading them with ctypes.

Each source is compiled once per source text, compiler, flags and CPU model (the code is
built for the host's instruction set, `-march=native`) into a cache folder, and loaded
from there afterwards. OpenMP comes from the runtime PyTorch already loaded (torch is
imported first and the library asks for the same soname), so a kernel's threads are
PyTorch's threads, not a second pool competing for the cores.

Vector code is chosen at compile time from what `-march=native` enables (`#if
__AVX512BF16__` / `__AVX2__` in the sources; `kernels/cpu/isa.h` reports which, see
`library_isa`). `NATSLLM_CPU_ISA=avx2` builds without AVX-512 (`-mno-avx512f`, a build
of its own in the cache), so that the AVX2 paths run and are tested on an AVX-512 host.

When no C compiler is found, or building fails, `load_library` returns None and logs
why once; the callers then run their PyTorch paths. `NATSLLM_NATIVE_KERNELS=0` turns
the C kernels off (for comparisons); `NATSLLM_KERNEL_CACHE` moves the cache folder.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch  # imported before any kernel library: it loads the OpenMP runtime they use

from shared import startup

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "cpu"
# -fno-trapping-math lets GCC vectorize nearbyintf (vroundps), and with it fast_expf's loops
# (softmax, SiLU); the values are the same, only FP exception flags are not kept.
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared")
# Per source: rotary and decode_layers (its embedding rows) must round every float32 product
# as PyTorch does (no fused multiply-add).
EXTRA_CFLAGS = {"rotary": ("-ffp-contract=off",), "decode_layers": ("-ffp-contract=off",)}
BUILD_TIMEOUT_S = 120
# NATSLLM_CPU_ISA: what each value adds to -march=native ("native": the host's widest).
ISA_CFLAGS = {"native": (), "avx2": ("-mno-avx512f",)}


def native_kernels_enabled() -> bool:
    return os.environ.get("NATSLLM_NATIVE_KERNELS", "1") != "0"


def cpu_isa() -> str:
    """The instruction set the kernels are built for: NATSLLM_CPU_ISA, default "native"."""
    isa = os.environ.get("NATSLLM_CPU_ISA", "native")
    if isa not in ISA_CFLAGS:
        raise ValueError(f"NATSLLM_CPU_ISA must be one of {', '.join(ISA_CFLAGS)}, got {isa!r}")
    return isa


def cache_dir() -> Path:
    if os.environ.get("NATSLLM_KERNEL_CACHE"):
        return Path(os.environ["NATSLLM_KERNEL_CACHE"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "natsllm" / "kernels"


def _cpu_model() -> str:
    """The host CPU's model name and feature flags (what -march=native compiles for)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    wanted = ("model name", "flags")
    return "\n".join(sorted({line for line in text.splitlines() if line.startswith(wanted)}))


def _find_compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _trusted(path: Path) -> bool:
    """A cached library is loaded only if this user owns it and nobody else can write it:
    loading a planted .so would run its code in the worker."""
    st = path.stat()
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


def _build(source: Path, compiler: str, flags: tuple[str, ...], target: Path) -> None:
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    # Build beside the target, then rename: concurrent builders never see half a file.
    fd, tmp = tempfile.mkstemp(prefix=target.stem, suffix=".so.tmp", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *flags, "-o", tmp, str(source)],
            check=True, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
        )  # fmt: skip
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def heads_packed(t: torch.Tensor) -> bool:
    """Whether `t` is [rows, heads, head_dim] with each row's heads side by side, the
    layout the C kernels take (rows may have any stride)."""
    return t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2]


_BINDINGS: list[Callable[[], None]] = []  # cache_clear of every kernel_binding


def kernel_binding(fn):
    """`functools.cache` for a function that binds a C kernel (with `bind`);
    `forget_libraries` clears it."""
    cached = functools.cache(fn)
    _BINDINGS.append(cached.cache_clear)
    return cached


def forget_libraries() -> None:
    """Forget every loaded library and bound kernel: the next calls load (or build) them
    again for the environment then (tests switch NATSLLM_CPU_ISA with it)."""
    load_library.cache_clear()
    for clear in _BINDINGS:
        clear()


def library_isa(name: str) -> str | None:
    """The instruction set library `name` was compiled for (avx512_bf16, avx512, avx2 or
    generic), None when it cannot be had."""
    lib = load_library(name)
    if lib is None:
        return None
    lib.natsllm_kernel_isa.restype = ctypes.c_char_p
    return lib.natsllm_kernel_isa().decode()


def bind(name: str, symbol: str, argtypes: list, restype=None):
    """Function `symbol` of library `name` with its ctypes signature set; None when the
    library cannot be had."""
    lib = load_library(name)
    if lib is None:
        return None
    fn = getattr(lib, symbol)
    fn.argtypes, fn.restype = argtypes, restype
    return fn


@functools.cache
def load_library(name: str) -> ctypes.CDLL | None:
    """The compiled `kernels/cpu/<name>.c`, built on first use; None when it cannot be."""
    if not native_kernels_enabled():
        return None
    compiler = _find_compiler()
    if compiler is None:
        logger.warning("no C compiler found: CPU kernel %s runs its PyTorch path", name)
        return None
    source = SOURCE_DIR / f"{name}.c"
    flags = CFLAGS + ISA_CFLAGS[cpu_isa()] + EXTRA_CFLAGS.get(name, ())
    headers = [h.read_bytes() for h in sorted(SOURCE_DIR.glob("*.h"))]
    key = hashlib.sha256(
        b"\0".join([source.read_bytes(), *headers, compiler.encode(), " ".join(flags).encode(), _cpu_model().encode()])
    ).hexdigest()[:16]
    target = cache_dir() / f"{name}-{key}.so"
    try:
        if not (target.exists() and _trusted(target)):
            startup.phase(f"compiling CPU kernel {name}")
            _build(source, compiler, flags, target)
        return ctypes.CDLL(str(target))
    except subprocess.CalledProcessError as exc:
        logger.warning("building CPU kernel %s failed; its PyTorch path runs instead:\n%s", name, exc.stderr)
    except (OSError, subprocess.TimeoutExpired) as exc:
        logger.warning("CPU kernel %s unavailable (%s); its PyTorch path runs instead", name, exc)
    return None
