"""The chaos run (scripts/chaos.py) through ``scripts/serve``: mixed load while random
processes of the stack are killed. A short run here (a minute of chaos, 2-4 kills), the
full 10 minutes marked slow. Either way: nothing hung, every greedy text completed equals
the fault-free run's, the engine ends with no request and no KV block, the launcher
stops cleanly, and every failure follows a kill (which ones, and why, is printed: a
gateway's death drops its clients' connections, docs/RELIABILITY.md).

The scaled-out run (slow) kills only schedulers and nats-servers of two data-parallel
engines on a three-node NATS cluster: the other engine and the other nodes cover for them,
so no request may fail at all.
"""

from __future__ import annotations

import pytest

from scripts.chaos import print_report, run

SCALED_OUT = ("--data-parallel-size", "2", "--nats-cluster", "3")
ONLY_ENGINES_AND_BUS = ("gateway", "tokenizer", "detokenizer", "0-worker-0", "1-worker-0")


@pytest.mark.parametrize("minutes,pool,concurrency,serve_args,spare", [
    pytest.param(1.0, 16, 8, (), (), id="short"),
    pytest.param(10.0, 160, 16, (), (), id="full", marks=pytest.mark.slow),
    pytest.param(3.0, 48, 16, SCALED_OUT, ONLY_ENGINES_AND_BUS, id="scaled-out", marks=pytest.mark.slow),
])
def test_chaos_loses_nothing(minutes, pool, concurrency, serve_args, spare, tmp_path):
    report = run(minutes=minutes, pool_size=pool, concurrency=concurrency, seed=3, spare=spare,
                 serve_args=serve_args, log_dir=tmp_path)
    print_report(report)
    assert report.kills and report.completed > 0 and report.greedy_compared > 0
    assert report.hung == []
    assert report.greedy_differing == []
    assert not report.leaked, report.engine_after
    assert report.unexplained_failures == 0, report.failed
    if "gateway" in spare:
        assert report.failed == []
    assert report.check_after_differing == 0
    assert report.launcher_exit == {"code": 0, "seconds": report.launcher_exit["seconds"], "left_running": []}
    assert report.ok
