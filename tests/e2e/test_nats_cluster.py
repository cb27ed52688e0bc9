"""The bus as a cluster: kill -9 one of three clustered nats-servers under 16 concurrent
greedy streams, and every stream completes with the text of the undisturbed run.

One stack for the module, as ``scripts/serve --nats-cluster 3`` runs it: three nodes with
routes between them and the per-role users, every service given all three URLs, two
tokenizers, two detokenizers, a worker, a scheduler and a gateway. The node killed is
the one a given service is connected to, so its clients must reconnect to another node
and what the node held is lost: the step or result in flight (the scheduler sees it in
the worker's heartbeats and starts over), deltas (the gateway asks for a resend),
stop-string broadcasts (asked for). The launcher restarts the node, it rejoins the
others, and the engine ends idle with no KV block held. By default the scheduler's node
is killed; the worker's and the gateway's are the slow-marked variants.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.e2e.stacks import replicated_config, running_stack, wait_until
from tests.e2e.test_faults import assert_idle_and_serving, run_streams


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    config = replicated_config(tmp_path_factory.mktemp("nats-cluster-logs"),
                               ["--max-num-seqs", "32", "--num-gpu-blocks", "512"])
    config.nats_cluster = 3
    with running_stack(config) as stack:
        yield stack


@pytest.fixture(scope="module")
def undisturbed(stack):
    outcomes, _ = asyncio.run(run_streams(stack))
    assert all(isinstance(o, str) and o for o in outcomes), outcomes
    return outcomes


@pytest.mark.parametrize("service", ["scheduler", pytest.param("worker", marks=pytest.mark.slow),
                                     pytest.param("gateway", marks=pytest.mark.slow)])
def test_killing_a_nats_node_under_load_costs_no_text(stack, undisturbed, service):
    cluster = stack.nats
    node = cluster.node_of(f"{service}-")
    assert node is not None, f"no {service} connection found"
    restarts = stack.supervisor.restart_counts()[node]
    outcomes, ended_after = asyncio.run(run_streams(stack, fault=lambda: stack.supervisor.kill(node)))
    print(f"killed {node} ({service}'s node): streams ended {ended_after:.1f}s later")
    assert outcomes == undisturbed
    wait_until(lambda: stack.supervisor.restart_counts()[node] == restarts + 1, 30, f"{node} not restarted")
    wait_until(cluster.meshed, 30, f"{node} did not rejoin the cluster")
    assert_idle_and_serving(stack)
