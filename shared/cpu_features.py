"""What the host CPU offers the CPU path, read from /proc/cpuinfo's feature flags.

``--dtype auto`` (``services/worker/dtype_choice.py``) asks ``native_bf16_dot``: bfloat16
weights pay off on a CPU only where it multiplies bf16 pairs natively (AVX512_BF16's
``vdpbf16ps``, or AMX tiles); elsewhere every bf16 product is widened to float32 first,
and on a 2-core AVX2 EPYC bf16 serving ran 4x slower than float32 at concurrency 32
(issue 15). The flags are Linux's names (``avx512_bf16``, ``amx_bf16``, ``avx2``).
"""

from __future__ import annotations

from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
# Flags that mean native bf16 dot products: AVX512_BF16 (vdpbf16ps) and AMX-BF16 (tiles).
BF16_DOT_FLAGS = ("avx512_bf16", "amx_bf16")


def parse_cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags of the first processor listed in ``cpuinfo`` (/proc/cpuinfo's text)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def cpu_flags(path: Path = CPUINFO) -> frozenset[str]:
    """This machine's CPU feature flags (empty where /proc/cpuinfo cannot be read)."""
    try:
        return parse_cpu_flags(path.read_text())
    except OSError:
        return frozenset()


def native_bf16_dot(flags: frozenset[str]) -> bool:
    """Whether a CPU with these flags has native bf16 dot products."""
    return any(flag in flags for flag in BF16_DOT_FLAGS)


def describe(flags: frozenset[str]) -> str:
    """The flags that matter to the CPU path, for logs and benchmark tables."""
    wanted = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")
    present = [flag for flag in wanted if flag in flags]
    return " ".join(present) if present else "none of avx2/avx512/amx"
