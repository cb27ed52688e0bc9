"""Prefill/decode disaggregation through the real services over NATS (TP=1).

One prefill engine (kv_producer) and one decode engine (kv_consumer), each a scheduler
and a worker process, with a tokenizer, a detokenizer and a gateway. The client sees one
ordinary stream; its greedy text equals the colocated engine's for 16 prompts (over 1,000
tokens, shared prefixes, one token, whole blocks); the decode engine's prefix cache saves
transfers; 32 concurrent streams complete and both engines' KV usage returns to 0.
"""

from __future__ import annotations

import pytest

from tests.e2e.pd_stacks import engine_stats, kv_idle, pd_config, run_all
from tests.e2e.stacks import running_stack, wait_until


@pytest.fixture(scope="module")
def pd_stack(tmp_path_factory):
    with running_stack(pd_config(tmp_path_factory.mktemp("pd-logs"))) as stack:
        yield stack


@pytest.fixture(scope="module")
def prompts(pd_prompts_and_texts):
    return pd_prompts_and_texts[0]


@pytest.fixture(scope="module")
def colocated(pd_prompts_and_texts):
    return pd_prompts_and_texts[1]


def test_greedy_through_prefill_and_decode_equals_colocated(pd_stack, prompts, colocated):
    texts = run_all(pd_stack, prompts)
    for i, (got, want) in enumerate(zip(texts, colocated)):
        assert got == want, f"prompt {i} ({len(prompts[i])} tokens): P/D {got!r} != colocated {want!r}"
    stats = engine_stats(pd_stack)
    decode = stats["decode-0"]
    assert decode.kv_role == "kv_consumer" and stats["prefill-0"].kv_role == "kv_producer"
    assert decode.kv_transfer_requests >= 8 and decode.kv_transfer_bytes > 0
    assert decode.kv_transfer_failures == 0 and decode.kv_transfer_fallbacks == 0
    assert decode.generation_tokens_total > 0 and stats["prefill-0"].generation_tokens_total >= 16


def test_decode_prefix_cache_hits_are_not_transferred(pd_stack, prompts, colocated):
    long_prompt = prompts[6]
    before = engine_stats(pd_stack)["decode-0"]
    assert run_all(pd_stack, [long_prompt]) == [colocated[6]]  # its prefix is cached on both sides now
    after = engine_stats(pd_stack)["decode-0"]
    block_bytes = before.kv_transfer_bytes // max(1, before.kv_transfer_requests)  # rough per-request size
    moved = after.kv_transfer_bytes - before.kv_transfer_bytes
    assert after.kv_transfer_requests in (before.kv_transfer_requests, before.kv_transfer_requests + 1)
    assert moved < block_bytes, f"{moved} bytes moved for a prompt the decode engine had cached"


def test_32_concurrent_streams_complete_and_kv_returns_to_zero(pd_stack, prompts, colocated):
    batch = (prompts * 2)[:32]
    texts = run_all(pd_stack, batch)
    assert texts == (colocated * 2)[:32]
    wait_until(lambda: kv_idle(pd_stack), 30, "both engines' KV usage back to 0")
