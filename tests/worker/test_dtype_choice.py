"""--dtype: what auto picks from the CPU's flags (mocked here) and the oneDNN probe, and
the warning for an explicit bfloat16 on a CPU without native bf16 dot products."""

import logging

import pytest
import torch

from services.worker import dtype_choice
from services.worker.dtype_choice import bf16_prepack_works, resolve_dtype

CPU = torch.device("cpu")
AVX2_ONLY = frozenset({"avx", "avx2", "fma"})
AVX512_BF16 = frozenset({"avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16"})
AMX = frozenset({"avx2", "avx512f", "amx_tile", "amx_bf16"})


def works():
    return True


def fails():
    return False


def test_auto_is_float32_without_native_bf16_dot_products(caplog):
    with caplog.at_level(logging.INFO, logger=dtype_choice.__name__):
        assert resolve_dtype("auto", CPU, AVX2_ONLY, works) == torch.float32
    assert "float32" in caplog.text and "no native bf16" in caplog.text and "avx2 fma" in caplog.text


@pytest.mark.parametrize("flags", [AVX512_BF16, AMX], ids=["avx512_bf16", "amx_bf16"])
def test_auto_is_bfloat16_with_native_bf16_and_prepacking(flags, caplog):
    with caplog.at_level(logging.INFO, logger=dtype_choice.__name__):
        assert resolve_dtype("auto", CPU, flags, works) == torch.bfloat16
    assert "bfloat16" in caplog.text and "prepacks" in caplog.text


def test_auto_is_float32_when_bf16_prepacking_fails(caplog):
    with caplog.at_level(logging.INFO, logger=dtype_choice.__name__):
        assert resolve_dtype("auto", CPU, AVX512_BF16, fails) == torch.float32
    assert "cannot prepack" in caplog.text


def test_explicit_bfloat16_without_native_bf16_warns_and_runs(caplog):
    with caplog.at_level(logging.WARNING, logger=dtype_choice.__name__):
        assert resolve_dtype("bfloat16", CPU, AVX2_ONLY, fails) == torch.bfloat16
    assert "without native bf16" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=dtype_choice.__name__):
        assert resolve_dtype("bfloat16", CPU, AVX512_BF16, works) == torch.bfloat16
    assert caplog.text == ""


def test_explicit_dtypes_and_cuda_are_not_probed():
    def never():
        raise AssertionError("probed")

    assert resolve_dtype("float32", CPU, AVX512_BF16, never) == torch.float32
    assert resolve_dtype("float16", CPU, AVX512_BF16, never) == torch.float16
    assert resolve_dtype("auto", torch.device("cuda"), AVX2_ONLY, never) == torch.bfloat16
    assert resolve_dtype("float32", torch.device("cuda"), AVX2_ONLY, never) == torch.float32


def test_the_probe_agrees_with_torch():
    # The real probe on this machine: it prepacks exactly where torch says oneDNN has bf16.
    supported = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert bf16_prepack_works() == supported
