"""P/D with ``--data-parallel-size 2``: two prefill and two decode engines. The tokenizers'
routers choose the prefill engine, each prefill scheduler's router the decode engine (prefix
and load); greedy output equals one engine's; both decode engines decode, and a prompt sent
again is decoded where its prefix is. Slow: four engines start on 2 cores."""

from __future__ import annotations

import pytest

from tests.e2e.pd_stacks import engine_stats, pd_config, run_all
from tests.e2e.stacks import running_stack

pytestmark = pytest.mark.slow


def test_pd_with_two_data_parallel_engines_per_role(tmp_path_factory, pd_prompts_and_texts):
    prompts, want = pd_prompts_and_texts
    config = pd_config(tmp_path_factory.mktemp("pd-dp-logs"))
    config.data_parallel_size = 2
    with running_stack(config, timeout=400) as stack:
        assert [e for e, _ in stack.config.engines()] == ["prefill-0", "prefill-1", "decode-0", "decode-1"]
        assert run_all(stack, prompts) == want
        stats = engine_stats(stack)
        assert all(stats[e].generation_tokens_total > 0 for e in ("decode-0", "decode-1")), "both decode"
        assert all(stats[e].prompt_tokens_total > 0 for e in ("prefill-0", "prefill-1")), "both prefill"
        # The long prompt again: its decode engine holds its blocks, so next to nothing moves.
        long_prompt = max(prompts, key=len)
        before = {e: s.kv_transfer_bytes for e, s in stats.items()}
        assert run_all(stack, [long_prompt]) == [want[prompts.index(long_prompt)]]
        after = engine_stats(stack)
        moved = sum(after[e].kv_transfer_bytes - before[e] for e in ("decode-0", "decode-1"))
        per_request = sum(s.kv_transfer_bytes for s in stats.values()) / max(
            1, sum(s.kv_transfer_requests for s in stats.values()))  # the long prompt is ~4x that
        assert moved < per_request, f"{moved} bytes moved for a prompt a decode engine held"
