"""--dtype: what auto picks from the CPU's flags (mocked here) and the oneDNN probe, and
the warning for an explicit bfloat16 on a CPU without native bf16 dot products."""

import logging

import pytest
import torch

from services.worker import dtype_choice
from services.worker.dtype_choice import bf16_prepack_works, resolve_dtype, resolve_kv_cache_dtype
from shared.config import CacheConfig, ConfigError

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


def test_auto_is_bfloat16_without_native_bf16_dot_products_where_the_weights_stay_quantized(caplog):
    with caplog.at_level(logging.INFO, logger=dtype_choice.__name__):
        assert resolve_dtype("auto", CPU, AVX2_ONLY, works, keep_quantized=True) == torch.bfloat16
    assert "bfloat16" in caplog.text and "stay quantized" in caplog.text
    # Dequantized (float) weights would multiply in bf16, widened on every call: float32.
    assert resolve_dtype("auto", CPU, AVX2_ONLY, works, keep_quantized=False) == torch.float32


@pytest.mark.parametrize("flags", [AVX512_BF16, AMX], ids=["avx512_bf16", "amx_bf16"])
def test_auto_is_bfloat16_with_native_bf16_and_prepacking(flags, caplog):
    with caplog.at_level(logging.INFO, logger=dtype_choice.__name__):
        assert resolve_dtype("auto", CPU, flags, works) == torch.bfloat16
    assert "bfloat16" in caplog.text and "prepacks" in caplog.text


def test_auto_is_float32_when_bf16_prepacking_fails(caplog):
    with caplog.at_level(logging.INFO, logger=dtype_choice.__name__):
        assert resolve_dtype("auto", CPU, AVX512_BF16, fails) == torch.float32
    assert "cannot prepack" in caplog.text
    assert resolve_dtype("auto", CPU, AVX512_BF16, fails, keep_quantized=True) == torch.bfloat16


def test_explicit_bfloat16_without_native_bf16_warns_and_runs(caplog):
    with caplog.at_level(logging.WARNING, logger=dtype_choice.__name__):
        assert resolve_dtype("bfloat16", CPU, AVX2_ONLY, fails) == torch.bfloat16
    assert "without native bf16" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=dtype_choice.__name__):
        assert resolve_dtype("bfloat16", CPU, AVX512_BF16, works) == torch.bfloat16
        assert resolve_dtype("bfloat16", CPU, AVX2_ONLY, works, keep_quantized=True) == torch.bfloat16
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


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", [CPU, torch.device("cuda")], ids=["cpu", "cuda"])
def test_kv_cache_dtype_auto_is_the_models(model_dtype, device):
    assert resolve_kv_cache_dtype("auto", model_dtype, device) == model_dtype


def test_explicit_kv_cache_dtypes_and_the_pairings_refused():
    assert resolve_kv_cache_dtype("bfloat16", torch.float32, CPU) == torch.bfloat16
    assert resolve_kv_cache_dtype("float32", torch.float32, CPU) == torch.float32
    with pytest.raises(ConfigError, match="bfloat16 under a float32 model on CPU"):
        resolve_kv_cache_dtype("float32", torch.bfloat16, CPU)
    with pytest.raises(ConfigError, match="on cuda"):
        resolve_kv_cache_dtype("bfloat16", torch.float32, torch.device("cuda"))


@pytest.mark.parametrize("name,message", [("fp8", "fp8 KV caches are not supported"),
                                          ("fp8_e5m2", "fp8 KV caches are not supported"),
                                          ("float16", "auto, bfloat16, float32")])
def test_cache_config_refuses_kv_cache_dtypes_it_cannot_honour(name, message):
    with pytest.raises(ConfigError, match=message):
        CacheConfig(kv_cache_dtype=name)
