"""--quantization's method names: vLLM's ``gguf`` keeps a GGUF file's quantized matrices as
``auto`` does, and stops start-up where it cannot; unknown names are refused listing the
accepted ones."""

from __future__ import annotations

import pytest

from services.worker.model_runner import ModelRunner
from shared.config import QUANTIZATION_METHODS, CacheConfig, ConfigError, ModelRunConfig, SchedulerConfig
from tests.hf_reference import make_tiny_random_llama


@pytest.mark.parametrize("method", ["awq", "gptq", "fp8", "GGUF", ""])
def test_an_unknown_method_is_refused_listing_the_accepted_ones(method):
    with pytest.raises(ConfigError, match=f"quantization must be one of none, auto, gguf, got {method!r}"):
        ModelRunConfig(quantization=method)
    assert QUANTIZATION_METHODS == ("none", "auto", "gguf")


@pytest.mark.parametrize("method, kind, tp, keeps", [
    ("gguf", "gguf", 1, True), ("auto", "gguf", 1, True), ("none", "gguf", 1, False),
    ("auto", "hf", 1, False), ("none", "hf", 1, False), ("auto", "gguf", 2, False), ("none", "gguf", 2, False),
])
def test_gguf_keeps_what_auto_keeps(method, kind, tp, keeps):
    assert ModelRunConfig(quantization=method).keeps_gguf_quantized(kind, tp) is keeps


def test_gguf_is_refused_for_a_hugging_face_folder_and_under_tp():
    with pytest.raises(ConfigError, match="quantization 'gguf' needs a GGUF model file; m is a Hugging Face folder"):
        ModelRunConfig(model="m", quantization="gguf").keeps_gguf_quantized("hf", 1)
    with pytest.raises(ConfigError, match="tensor parallelism does not shard"):
        ModelRunConfig(quantization="gguf").keeps_gguf_quantized("gguf", 2)


def runner(model: str, method: str) -> ModelRunner:
    return ModelRunner(ModelRunConfig(model=model, kernel_backend="torch", dtype="float32", quantization=method),
                       CacheConfig(num_gpu_blocks=8), SchedulerConfig(max_num_seqs=2))


def test_a_worker_with_gguf_keeps_the_default_files_matrices_quantized(smollm_path):
    worker = runner(smollm_path, "gguf")
    assert worker.keep_quantized and worker.model.num_quantized() > 0


def test_a_worker_with_gguf_on_a_hugging_face_folder_stops_at_start_up(tmp_path):
    folder = make_tiny_random_llama(tmp_path, seed=0, num_heads=4, num_kv_heads=2)
    with pytest.raises(ConfigError, match=f"quantization 'gguf' needs a GGUF model file; {folder}"):
        runner(str(folder), "gguf")
    assert runner(str(folder), "auto").model.num_quantized() == 0  # auto: nothing to keep, no error
