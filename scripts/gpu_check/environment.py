"""The check's environment step: versions, the device, and a first Triton kernel.

Records the machine's Python, torch (and its CUDA), Triton, transformers and tokenizers,
the GPU's name, memory, multiprocessors, L2 and driver, then runs the Triton RMSNorm once
against its reference: if Triton cannot compile or launch here, this says so first.
"""

from __future__ import annotations

import os
import platform
import subprocess

from gpu_check.step import StepContext


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except Exception as exc:  # missing or broken: say which
        return f"unavailable ({type(exc).__name__})"


def _driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def run(ctx: StepContext) -> None:
    import torch

    versions = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
                "triton": _version("triton"), "transformers": _version("transformers"),
                "tokenizers": _version("tokenizers")}
    ctx.record("versions", versions)
    ctx.record("cpu_count", os.cpu_count())
    ctx.record("cuda", torch.cuda.is_available())
    ctx.record("triton_interpret", os.environ.get("TRITON_INTERPRET") == "1")
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        ctx.record("device_name", props.name)
        ctx.record("capability", f"{props.major}.{props.minor}")
        ctx.record("memory_gib", round(props.total_memory / 2**30, 1))
        ctx.record("multiprocessors", props.multi_processor_count)
        l2 = getattr(props, "L2_cache_size", None)
        ctx.record("l2_mib", round(l2 / 2**20, 1) if l2 else None)
        ctx.record("driver", _driver())
    elif not ctx.dry_run:
        ctx.fail("no CUDA device: torch.cuda.is_available() is False (the later steps need one)")
        return

    from kernels.rms_norm import rms_norm_ref, rms_norm_triton

    x = torch.randn(7, 576, device=ctx.device)
    weight = torch.randn(576, device=ctx.device)
    got = rms_norm_triton(x, weight, 1e-5)
    want = rms_norm_ref(x, weight, 1e-5)
    error = float((got - want).abs().max())
    ctx.record("first_triton_kernel", {"kernel": "rms_norm_triton", "max_abs_error": error})
    if not error <= 1e-5:
        ctx.fail(f"the first Triton kernel (RMSNorm) differs from its reference by {error:.2e}")


def summary(data: dict) -> str:
    versions = data.get("versions", {})
    device = data.get("device_name") or "no GPU"
    return (f"{device}; torch {versions.get('torch')} (CUDA {versions.get('cuda')}), triton {versions.get('triton')}, "
            f"transformers {versions.get('transformers')}")


def section(data: dict) -> list[str]:
    keys = ("device_name", "capability", "memory_gib", "multiprocessors", "l2_mib", "driver", "cpu_count",
            "triton_interpret", "first_triton_kernel")
    return [f"- {key}: {data[key]}" for key in keys if key in data]
