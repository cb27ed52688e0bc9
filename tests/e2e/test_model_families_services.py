"""Model families beyond Llama through the real services at TP=2 (4 heads, 2 KV heads: one
KV head per rank), against transformers.

Gemma 3 (sliding and global KV cache groups: the scheduler learns them from the workers'
ready messages) and Phi-3 (fused checkpoint tensors cut per rank) run by default; every
family with ``-m slow``. Completion prompts longer than the sliding window; the text equals
what transformers' greedy tokens decode to.
"""

from __future__ import annotations

import httpx
import pytest

from services.launch.nats_server import free_port
from services.launch.stack import StackConfig
from shared.tokenizer import load_tokenizer
from tests.e2e.stacks import metric, running_stack, wait_until
from tests.hf_reference import hf_greedy, load_hf_model_from_folder
from tests.tiny_models import TINY_CONFIGS, make_tiny_model

PROMPTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a wooden screw press.",
    "Within decades, print shops spread across Europe, books became cheaper, and ideas travelled faster.",
]
NUM_TOKENS = 24
DEFAULT = ["gemma3", "phi3"]
FAMILIES = [pytest.param(arch, marks=[] if arch in DEFAULT else pytest.mark.slow) for arch in sorted(TINY_CONFIGS)]


@pytest.mark.parametrize("arch", FAMILIES)
def test_tp2_services_greedy_equals_transformers(arch, tmp_path):
    folder = make_tiny_model(arch, tmp_path / arch, seed=2)
    tokenizer = load_tokenizer(folder)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    window = load_hf_model_from_folder(folder).config.sliding_window or 0
    assert min(len(p) for p in prompts) > window
    refs = hf_greedy(load_hf_model_from_folder(folder), prompts, NUM_TOKENS, stop_at_eos=False)
    logs = tmp_path / "logs"
    logs.mkdir()
    config = StackConfig(port=free_port(), model=str(folder), tensor_parallel_size=2,
                         args=["--num-gpu-blocks", "256"], log_dir=str(logs))
    with running_stack(config) as stack:
        for text, (want, _) in zip(PROMPTS, refs):
            body = {"model": folder.name, "prompt": text, "max_tokens": NUM_TOKENS, "temperature": 0,
                    "ignore_eos": True}
            resp = httpx.post(stack.base_url + "/v1/completions", json=body, timeout=120)
            assert resp.status_code == 200, resp.text
            choice = resp.json()["choices"][0]
            assert choice["text"] == tokenizer.decode(want).rstrip("\ufffd"), (arch, want)
            assert resp.json()["usage"]["completion_tokens"] == NUM_TOKENS
        # Every block back in the pool (the null block is none of the pool's blocks).
        wait_until(lambda: metric(stack, "natsllm:kv_cache_usage_perc") == 0.0, 30, "blocks still held")
