"""scripts/serve's start-up progress (services/launch/progress.py) from status files."""

from __future__ import annotations

import json

from services.launch.progress import StartupProgress


def write(path, **status) -> None:
    path.write_text(json.dumps(status))


def test_every_phase_is_shown_once_even_those_begun_and_ended_between_two_looks(tmp_path):
    worker, gateway = tmp_path / "worker-0.json", tmp_path / "gateway.json"
    progress = StartupProgress({"worker-0": str(worker), "gateway": str(gateway)})
    assert progress.changes() == [] and progress.waiting() == ["worker-0", "gateway"]
    write(worker, phase="loading weights", starting=True, history=[["starting the process", 0.1],
                                                                   ["loading weights", 1.0]])
    assert progress.changes() == ["[   0.1s] worker-0: starting the process", "[   1.0s] worker-0: loading weights"]
    assert progress.changes() == []
    # Two phases came and went before the next look; the service is on the bus now.
    write(worker, phase="serving", history=[["starting the process", 0.1], ["loading weights", 1.0],
                                            ["profiling memory: sizing the KV cache", 3.5],
                                            ["connecting to the bus", 3.6]], started_at=0)
    write(gateway, phase="waiting for a ready engine", history=[["starting the process", 0.2]], started_at=0)
    lines = progress.changes()
    assert [line.split("] ", 1)[1] for line in lines] == [
        "worker-0: profiling memory: sizing the KV cache", "worker-0: connecting to the bus", "worker-0: serving",
        "gateway: starting the process", "gateway: waiting for a ready engine"]
    assert progress.waiting() == ["gateway"]
    write(gateway, phase="serving", history=[["starting the process", 0.2]], started_at=0)
    assert [line.split("] ", 1)[1] for line in progress.changes()] == ["gateway: serving"]
    assert progress.waiting() == []
