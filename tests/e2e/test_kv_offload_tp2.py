"""The tiered KV cache at TP=2 through the real services (a tiny random Llama, 2 KV heads: one
per rank): each rank stores and loads its shard of every unit, in its own disk namespace,
and rank 0 reports a load once both ranks did it. Greedy output equals the in-process TP=1
engine without tiers, for documents that outgrow the device pool and come back from the
host tier, and from disk after the engine's processes restart."""

from __future__ import annotations

import random
import time

import httpx
import pytest

from services.launch.nats_server import free_port
from services.launch.stack import StackConfig
from tests.e2e.stacks import metric, running_stack, wait_until
from tests.hf_reference import make_tiny_random_llama

NUM_TOKENS = 8
rng = random.Random(11)
# Three token-id documents of 15 blocks: together more than the 32-block pool.
DOCUMENTS = [[rng.randrange(3, 320) for _ in range(15 * 16)] for _ in range(3)]
QUESTION = [rng.randrange(3, 320) for _ in range(7)]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(make_tiny_random_llama(tmp_path_factory.mktemp("tiny-kv-tp"), seed=3, num_heads=4, num_kv_heads=2))


@pytest.fixture(scope="module")
def tp_stack(model_path, tmp_path_factory):
    folder = tmp_path_factory.mktemp("kv-tp-tier")
    config = StackConfig(port=free_port(), model=model_path, tensor_parallel_size=2,
                         args=["--num-gpu-blocks", "32", "--kv-offloading-size", "0.01",
                               "--kv-offloading-path", str(folder)],
                         log_dir=str(tmp_path_factory.mktemp("kv-tp-logs")))
    with running_stack(config) as stack:
        yield stack, folder


def reference(model_path) -> list[list[int]]:
    from services.engine import Engine
    from shared.config import CacheConfig, ModelRunConfig
    from shared.protocol import SamplingParams

    engine = Engine(ModelRunConfig(model=model_path, dtype="float32", quantization="none"),
                    CacheConfig(num_gpu_blocks=128))
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    return [r.token_ids for r in engine.generate([doc + QUESTION for doc in DOCUMENTS], params)]


def complete(stack, model_path, prompt) -> tuple[str, int]:
    """The greedy text and the cached prompt tokens."""
    body = {"model": model_path.rstrip("/").rsplit("/", 1)[-1], "prompt": prompt, "max_tokens": NUM_TOKENS,
            "temperature": 0, "ignore_eos": True}
    r = httpx.post(stack.base_url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_tp2_with_tiers_gives_tp1s_greedy_text_from_the_host_tier_and_after_a_restart_from_disk(tp_stack,
                                                                                                model_path):
    stack, folder = tp_stack
    from shared.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_path)
    want = [tokenizer.decode(ids).rstrip("\ufffd") for ids in reference(model_path)]
    for _ in range(2):  # round 2: the documents come back from the host tier
        got = [complete(stack, model_path, doc + QUESTION) for doc in DOCUMENTS]
        assert [text for text, _ in got] == want
    assert all(cached >= 14 * 16 for _, cached in got)
    model = model_path.rstrip("/").rsplit("/", 1)[-1]
    host_hits = 'natsllm:kv_offload_tiering_block_hits_total{model_name="%s",tier="CPU"}' % model
    wait_until(lambda: metric(stack, host_hits) > 0, 10, "no host-tier hits in /metrics")  # stats every second
    namespaces = sorted(p.name for p in folder.iterdir())
    assert [n.rsplit("-", 1)[1] for n in namespaces] == ["tp0of2", "tp1of2"]  # a namespace per rank
    # Each rank writes its files in its own idle time: both must have written every document's
    # full blocks (one file each) before the kill, or the restarted engine has half a unit.
    full_blocks = len(DOCUMENTS) * ((len(DOCUMENTS[0]) + len(QUESTION)) // 16)
    wait_until(lambda: all(sum(1 for p in (folder / n).rglob("*.kv")) >= full_blocks for n in namespaces), 30,
               "a rank did not write its unit files")
    # Both ranks' engine processes restart: the host tier is gone, the disk tier is not.
    for name in ("worker-0", "worker-1", "scheduler"):
        stack.restart_service(name)
    stack.wait_ready()
    deadline = time.monotonic() + 120
    while True:
        try:
            text, cached = complete(stack, model_path, DOCUMENTS[0] + QUESTION)
            break
        except AssertionError:
            assert time.monotonic() < deadline
            time.sleep(1)
    assert text == want[0] and cached >= 14 * 16
    disk_hits = 'natsllm:kv_offload_tiering_block_hits_total{model_name="%s",tier="DISK"}' % model
    wait_until(lambda: metric(stack, disk_hits) > 0, 10, "no disk hits in /metrics")  # stats come every second
