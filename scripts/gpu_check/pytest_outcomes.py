"""A pytest plugin of the GPU check: each test's outcome appended to a JSON-lines file as it
comes (``GPU_CHECK_OUTCOMES`` names it), so a run stopped at its time limit still tells
which tests passed and which failed. Loaded with ``-p gpu_check.pytest_outcomes``; under
pytest-xdist only the controller writes (it receives every worker's reports).

``GPU_CHECK_ONE_CASE=1`` (the dry run) keeps the first case of each parametrized test: the
default suite runs them all on the CPU already; the dry run only proves the step works."""

from __future__ import annotations

import json
import os

MESSAGE_LIMIT = 1500
_in_xdist_worker = False


def pytest_configure(config):
    global _in_xdist_worker
    _in_xdist_worker = hasattr(config, "workerinput")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("GPU_CHECK_ONE_CASE") != "1":
        return
    seen, keep, drop = set(), [], []
    for item in items:
        test = item.nodeid.split("[")[0]
        (drop if test in seen else keep).append(item)
        seen.add(test)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_runtest_logreport(report):
    path = os.environ.get("GPU_CHECK_OUTCOMES")
    if not path or _in_xdist_worker:
        return
    if report.when == "call":
        outcome = report.outcome
    elif report.failed:
        outcome = "error"  # a fixture's setup or teardown failed
    elif report.when == "setup" and report.skipped:
        outcome = "skipped"
    else:
        return
    entry = {"test": report.nodeid, "outcome": outcome, "seconds": round(report.duration, 3)}
    if report.failed or report.skipped:
        entry["message"] = str(report.longrepr)[-MESSAGE_LIMIT:]
    with open(path, "a") as f:
        f.write(json.dumps(entry) + "\n")
