"""Two data-parallel engines (``--data-parallel-size 2``) through the real services, with two
tokenizer replicas (two routers) in kv mode.

Greedy output equals one engine's token for token (16 prompts: long ones, shared prefixes,
one token, whole blocks); both engines serve; a conversation's later turns land on the engine
holding its prefix (that engine's prefix-cache hits, the other's none); /metrics shows the
prefix cache per engine and the routers' decisions by reason.
"""

from __future__ import annotations

import httpx
import pytest

from services.launch.nats_server import free_port
from services.launch.stack import StackConfig
from tests.e2e.pd_stacks import PARAGRAPH, PD_ARGS, engine_stats, run_all
from tests.e2e.stacks import running_stack, wait_until


@pytest.fixture(scope="module")
def dp_stack(tmp_path_factory):
    config = StackConfig(port=free_port(), data_parallel_size=2, num_tokenizers=2, args=PD_ARGS,
                         log_dir=str(tmp_path_factory.mktemp("dp-logs")))
    with running_stack(config) as stack:
        yield stack


def test_greedy_through_two_engines_equals_one_engine(dp_stack, pd_prompts_and_texts):
    assert [e for e, _ in dp_stack.config.engines()] == ["0", "1"]
    assert {"engine-0-scheduler", "engine-1-scheduler", "engine-0-worker-0", "engine-1-worker-0"} <= set(
        dp_stack.processes)
    prompts, want = pd_prompts_and_texts
    texts = run_all(dp_stack, prompts)
    for i, (got, expected) in enumerate(zip(texts, want)):
        assert got == expected, f"prompt {i} ({len(prompts[i])} tokens): DP=2 {got!r} != one engine {expected!r}"
    stats = engine_stats(dp_stack)
    assert set(stats) == {"0", "1"} and all(s.prompt_tokens_total > 0 for s in stats.values()), "both serve"
    assert all(s.kv_events_seq > 0 and s.block_size == 16 for s in stats.values())


def test_later_turns_land_on_the_engine_holding_the_prefix(dp_stack, smollm_tokenizer):
    prefix = smollm_tokenizer.encode("A new conversation. " + PARAGRAPH * 6)  # ~230 tokens, its own blocks
    before = engine_stats(dp_stack)
    run_all(dp_stack, [prefix + smollm_tokenizer.encode(" First question?")])
    for i in range(4):  # one at a time: each finds the last one's blocks
        run_all(dp_stack, [prefix + smollm_tokenizer.encode(f" Question number {i}?")])
    after = engine_stats(dp_stack)
    hits = {e: after[e].prefix_cache_hits - before[e].prefix_cache_hits for e in after}
    holder = max(hits, key=hits.get)
    full_blocks = (len(prefix) // 16) * 16
    assert hits[holder] >= 4 * (full_blocks - 16), hits
    assert min(hits.values()) == 0, f"the prefix was computed on both engines: {hits}"


def test_metrics_show_the_prefix_cache_per_engine_and_router_decisions(dp_stack):
    def lines():
        text = httpx.get(dp_stack.base_url + "/metrics", timeout=10).text
        return [line for line in text.splitlines() if not line.startswith("#")]

    wait_until(lambda: any(line.startswith("natsllm:router_decisions_total") for line in lines()), 5,
               "the routers' stats in /metrics")
    text = "\n".join(lines())
    for engine in ("0", "1"):
        assert f'natsllm:prefix_cache_queries_total{{engine="{engine}"' in text
        assert f'natsllm:prefix_cache_hits_total{{engine="{engine}"' in text
    assert 'reason="kv_prefix"' in text
