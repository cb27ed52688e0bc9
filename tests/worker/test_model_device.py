"""Every model class builds under a default device other than the CPU, as the model runner
builds it (``with torch.device(cuda)``): a constructor that made one tensor on the CPU and
another on the default device crashed every worker at start-up on the first GPU run.

The meta device stands in for CUDA here: like CUDA it is not the CPU, and an operation
mixing it with a CPU tensor fails the same way.
"""

from __future__ import annotations

import pytest
import torch

from kernels import get_kernel_ops
from services.worker.models.registry import model_class
from services.worker.parallel import TensorParallel
from shared.model_files import load_model_config
from tests.hf_reference import make_tiny_random_llama
from tests.tiny_models import TINY_CONFIGS, make_tiny_model

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 256}


def _folder(arch: str, tmp_path):
    if arch == "llama":
        return make_tiny_random_llama(tmp_path, seed=0)
    if arch == "llama3-scaled":
        return make_tiny_random_llama(tmp_path, seed=0, rope_scaling=LLAMA3_SCALING)
    return make_tiny_model(arch, tmp_path)


@pytest.mark.parametrize("arch", ["llama", "llama3-scaled", *TINY_CONFIGS])
def test_model_builds_on_a_device_other_than_the_cpu(arch, tmp_path):
    config = load_model_config(_folder(arch, tmp_path))
    with torch.device("meta"):
        model = model_class(config)(config, get_kernel_ops("torch"), TensorParallel.single())
    devices = {p.device.type for p in model.parameters()}
    assert devices == {"meta"}, f"{arch}: parameters on {devices}"
    tables = [value for module in model.modules() for value in vars(module).values()
              if hasattr(value, "cos_sin_cache")]
    assert tables, f"{arch}: no rotary table found"
    assert {t.cos_sin_cache.device.type for t in tables} == {"meta"}
