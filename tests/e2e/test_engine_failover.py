"""Engines cover for each other: kill -9 one engine's scheduler under 16 concurrent greedy
streams on ``--data-parallel-size 2``, and no client sees it.

One stack for the module: nats-server with authentication, two tokenizers (two routers),
two detokenizers, a gateway, and two data-parallel engines (a scheduler and a worker
each). The killed scheduler is not started again: its engine is silent from then on, the
gateway resumes its requests after ``--engine-heartbeat-timeout``, and the other engine
takes them (the routers' choice; the dead engine has no responder, so the queue group
takes what is still routed to it), recomputed from prompt + the tokens their clients
have. Every stream ends with the text of the undisturbed run, and the surviving engine
ends idle with no KV block held.
"""

from __future__ import annotations

import asyncio
import time

import nats
import pytest

from shared.protocol import ENGINE_STATS_CHANNEL
from tests.e2e.stacks import metric, replicated_config, running_stack, wait_until
from tests.e2e.test_faults import assert_idle_and_serving, run_streams

def ready_engines(stack, seconds: float = 2.5) -> set[str]:
    """The engines whose stats say ready within ``seconds``."""

    async def listen() -> set[str]:
        nc = await nats.connect(stack.nats.url, **stack.nats.credentials("admin"))
        ready: set[str] = set()
        try:
            sub = await nc.subscribe(ENGINE_STATS_CHANNEL.subject())
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                try:
                    stats = ENGINE_STATS_CHANNEL.decode((await sub.next_msg(timeout=0.5)).data)
                except nats.errors.TimeoutError:
                    continue
                if stats.ready:
                    ready.add(stats.engine_id)
        finally:
            await nc.close()
        return ready

    return asyncio.run(listen())


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    args = ["--max-num-seqs", "32", "--num-gpu-blocks", "512", "--engine-heartbeat-timeout", "2"]
    config = replicated_config(tmp_path_factory.mktemp("failover-logs"), args)
    config.data_parallel_size = 2
    with running_stack(config) as stack:
        wait_until(lambda: ready_engines(stack) == {"0", "1"}, 60, "both engines are not ready")
        yield stack


def test_a_dead_engines_streams_go_on_on_the_other_engine_with_the_same_text(stack):
    undisturbed, _ = asyncio.run(run_streams(stack))
    assert all(isinstance(o, str) and o for o in undisturbed), undisturbed
    resumed = metric(stack, "natsllm:requests_resumed_total")

    def kill_for_good():
        # Engine 0's scheduler dies and stays dead: only engine 1 can take its requests.
        child = stack.supervisor.children.pop("engine-0-scheduler")
        child.process.kill()

    outcomes, ended_after = asyncio.run(run_streams(stack, fault=kill_for_good))
    print(f"streams ended {ended_after:.1f}s after the kill")
    assert outcomes == undisturbed
    assert metric(stack, "natsllm:requests_resumed_total") > resumed  # engine 0 held streams
    assert ready_engines(stack) == {"1"}
    assert_idle_and_serving(stack)
