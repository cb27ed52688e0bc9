"""Session fixtures: heavy models are loaded once and shared by every test."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# The benchmark harness (scripts/bench/: the corpus, the streaming client, the OTLP receiver
# the tracing tests use) and the benchmark scripts are run from scripts/, not installed.
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))

# Without a GPU the Triton kernels run under Triton's interpreter. triton.jit reads
# this when a kernel is decorated, i.e. when `kernels` is first imported: it must be
# set before any test module is collected.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The services started here build the structured-output backend only for a constrained
# request: built at start-up (the default), it would cost the suite's ~100 tokenizer and
# worker starts ~4 min of CPU. tests/e2e/test_structured_output.py turns it on.
os.environ.setdefault("STRUCTURED_OUTPUTS_WARMUP", "false")

# The longest single tests (a subprocess each: ~3 min and ~1.5 min on CI's 2 cores) start
# first, so that in several test processes (scripts/test) neither is left running alone at
# the end; the other files keep their order.
LONGEST_FIRST = ("tests/scripts/test_gpu_check.py", "tests/e2e/test_chaos.py")


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in LONGEST_FIRST)


@pytest.fixture(scope="session")
def smollm_path():
    from shared.model_config import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm_tokenizer(smollm_path):
    from shared.tokenizer import load_tokenizer

    return load_tokenizer(smollm_path)


@pytest.fixture(scope="session")
def smollm_worker(smollm_path):
    """The default model on CPU in fp32 with a deliberately small KV pool (48 blocks)."""
    from services.worker.model_runner import ModelRunner
    from shared.config import CacheConfig, ModelRunConfig, SchedulerConfig

    return ModelRunner(
        ModelRunConfig(model=smollm_path, kernel_backend="torch", dtype="float32", quantization="none"),
        CacheConfig(num_gpu_blocks=48),
        SchedulerConfig(max_num_seqs=16),
    )


@pytest.fixture(scope="session")
def hf_smollm(smollm_path):
    from tests.hf_reference import load_hf_model_from_gguf

    return load_hf_model_from_gguf(smollm_path)


@pytest.fixture(scope="session")
def hf_smollm_greedy(hf_smollm):
    """``hf_greedy`` of ``hf_smollm``, memoised for the session (``GreedyReferences``): modules
    that compare with it on the same prompts share one run."""
    from tests.hf_reference import GreedyReferences

    return GreedyReferences(lambda: hf_smollm)


@pytest.fixture(scope="session")
def hf_lora_greedy(hf_smollm):
    """``hf_lora_greedy(folder, prompts, max_new_tokens, ...)``: ``hf_greedy`` of Hugging Face +
    PEFT with the LoRA adapter in ``folder`` on the default model, memoised per folder for the
    session. The PEFT model is built for each call that has prompts not run yet, then dropped."""
    from tests.hf_reference import GreedyReferences
    from tests.lora_reference import hf_with_adapter

    by_folder: dict[str, GreedyReferences] = {}

    def references(folder, prompts, max_new_tokens, stop_at_eos=True):
        folder = str(folder)
        if folder not in by_folder:
            by_folder[folder] = GreedyReferences(lambda: hf_with_adapter(hf_smollm, folder))
        return by_folder[folder](prompts, max_new_tokens, stop_at_eos)

    return references


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A random tiny Llama (GQA) saved as a Hugging Face folder: (our worker, HF model)."""
    from services.worker.model_runner import ModelRunner
    from shared.config import CacheConfig, ModelRunConfig, SchedulerConfig
    from tests.hf_reference import load_hf_model_from_folder, make_tiny_random_llama

    path = make_tiny_random_llama(tmp_path_factory.mktemp("tiny-llama"), seed=0, num_heads=4, num_kv_heads=2)
    worker = ModelRunner(
        ModelRunConfig(model=str(path), kernel_backend="torch", dtype="float32", quantization="none"),
        CacheConfig(num_gpu_blocks=40),
        SchedulerConfig(max_num_seqs=16),
    )
    return worker, load_hf_model_from_folder(path)
