"""Routing through faults, on ``--data-parallel-size 2`` with two routers (tokenizer
replicas) in kv mode: 5% of the KV event batches are dropped on the way
(``NATSLLM_TEST_KV_EVENT_FAULTS``) and one router is killed (-9) half way through a
shared-prefix load (the launcher restarts it). Every request completes; the routers find the
holes and have them replayed (/metrics); the restarted router rebuilds its index and the
hit rate after the restart is as high as before. Slow: a few hundred requests on 2 cores."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from services.launch.nats_server import free_port
from services.launch.stack import StackConfig
from shared.kv_event_faults import ENV_VAR
from tests.e2e.stacks import running_stack

pytestmark = pytest.mark.slow

GROUPS, PREFIX, SUFFIX, REQUESTS = 6, 192, 16, 120


async def one(http, prompt):
    body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}
    r = await http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def hit_rate(results):
    return sum(c for _, c in results) / sum(p for p, _ in results)


def test_dropped_events_and_a_router_restart_cost_almost_no_hits(tmp_path_factory):
    rng = random.Random(0)
    prefixes = [[rng.randrange(200, 40000) for _ in range(PREFIX)] for _ in range(GROUPS)]
    prompts = [rng.choice(prefixes) + [rng.randrange(200, 40000) for _ in range(SUFFIX)] for _ in range(REQUESTS)]
    config = StackConfig(port=free_port(), data_parallel_size=2, num_tokenizers=2,
                         env={ENV_VAR: "drop=0.05,seed=3"}, log_dir=str(tmp_path_factory.mktemp("routing-faults")),
                         args=["--num-gpu-blocks", "96"])
    with running_stack(config) as stack:
        async def go():
            async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as http:
                results = []
                for i in range(0, REQUESTS, 4):  # four at a time, below saturation
                    if i == REQUESTS // 2:
                        stack.supervisor.kill("tokenizer-0")
                    results += await asyncio.gather(*(one(http, p) for p in prompts[i:i + 4]))
                return results

        results = asyncio.run(go())
        half = REQUESTS // 2
        before, after = hit_rate(results[GROUPS * 2:half]), hit_rate(results[half + 20:])
        assert before > 0.6, before
        assert after >= before - 0.05, (before, after)
        time.sleep(1.5)
        metrics = httpx.get(stack.base_url + "/metrics", timeout=10).text
        gaps = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                   if line.startswith("natsllm:router_kv_event_gaps_total{"))
        assert gaps >= 1
        assert stack.supervisor.restart_counts().get("tokenizer-0", 0) == 1
