"""P/D at TP=2 on both sides (gloo on CPU), against a colocated TP=2 engine.

Two stacks, one after the other: a colocated engine with two worker ranks, then one
prefill and one decode engine with two ranks each (decode rank r pulls its KV heads from
prefill rank r). The 16 prompts of the TP=1 test give the same greedy text on both.
"""

from __future__ import annotations

import pytest

from services.launch.nats_server import free_port
from services.launch.stack import StackConfig
from tests.e2e.pd_stacks import PD_ARGS, engine_stats, kv_idle, pd_config, pd_prompts, run_all
from tests.e2e.stacks import running_stack, wait_until

TP = 2


@pytest.fixture(scope="module")
def prompts(smollm_tokenizer):
    return pd_prompts(smollm_tokenizer)


@pytest.fixture(scope="module")
def colocated_tp2(prompts, tmp_path_factory):
    config = StackConfig(port=free_port(), tensor_parallel_size=TP, args=PD_ARGS,
                         log_dir=str(tmp_path_factory.mktemp("colocated-tp2-logs")))
    with running_stack(config) as stack:
        return run_all(stack, prompts)


def test_tp2_prefill_and_decode_equal_colocated_tp2(prompts, colocated_tp2, tmp_path_factory):
    with running_stack(pd_config(tmp_path_factory.mktemp("pd-tp2-logs"), tp=TP)) as stack:
        texts = run_all(stack, prompts)
        for i, (got, want) in enumerate(zip(texts, colocated_tp2)):
            assert got == want, f"prompt {i} ({len(prompts[i])} tokens): P/D {got!r} != colocated {want!r}"
        decode = engine_stats(stack)["decode-0"]
        assert decode.kv_transfer_requests >= 8 and decode.kv_transfer_fallbacks == 0
        wait_until(lambda: kv_idle(stack), 30, "KV blocks left over")
