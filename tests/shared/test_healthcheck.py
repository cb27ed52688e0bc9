"""The heartbeat file (shared/healthcheck.py) on a real nats-server: fresh while a
service's event loop runs and its bus answers, stale once either stops."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from services.launch.nats_server import NatsServer
from shared import healthcheck
from shared.bus import Service

ROOT = Path(__file__).resolve().parents[2]
MAX_AGE = "1"  # seconds; the test service beats every 0.1 s


class IdleService(Service):
    name = "idle"

    def info(self) -> dict:
        return {"num_requests": 3}


@contextlib.contextmanager
def service_in_thread(url: str, path: str):
    """A service on its own event loop in a thread, so the test can block that loop."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    service = IdleService(url)
    service.heartbeat_file = path
    service.heartbeat_interval = 0.1
    asyncio.run_coroutine_threadsafe(service.start(), loop).result(10)
    try:
        yield service, loop
    finally:
        asyncio.run_coroutine_threadsafe(service.close(), loop).result(20)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def healthy(path: str) -> bool:
    return healthcheck.main(["--file", path, "--max-age", MAX_AGE]) == 0


def test_fresh_while_connected_stale_once_the_bus_is_lost(tmp_path):
    path = str(tmp_path / "heartbeat")
    assert not healthy(path)  # never started
    server = NatsServer()
    try:
        with service_in_thread(server.url, path):
            wait_until(lambda: healthy(path))
            first = os.stat(path).st_mtime_ns
            wait_until(lambda: os.stat(path).st_mtime_ns > first)  # it keeps beating
            # The command compose runs, as a process of its own.
            env = {**os.environ, "HEARTBEAT_FILE": path, "PYTHONPATH": str(ROOT)}
            check = subprocess.run([sys.executable, "-m", "shared.healthcheck"], env=env, cwd=ROOT,
                                   capture_output=True, text=True, timeout=60)
            assert check.returncode == 0, check.stderr
            server.stop()
            wait_until(lambda: not healthy(path))
            check = subprocess.run([sys.executable, "-m", "shared.healthcheck", "--max-age", MAX_AGE], env=env,
                                   cwd=ROOT, capture_output=True, text=True, timeout=60)
            assert check.returncode == 1 and "unhealthy" in check.stderr
    finally:
        server.stop()


def test_the_file_holds_what_a_ping_answers_and_show_prints_it(tmp_path):
    path = str(tmp_path / "heartbeat")
    with NatsServer() as server, service_in_thread(server.url, path) as (service, _):
        wait_until(lambda: healthy(path))
        env = {**os.environ, "HEARTBEAT_FILE": path, "PYTHONPATH": str(ROOT)}
        check = subprocess.run([sys.executable, "-m", "shared.healthcheck", "--show"], env=env, cwd=ROOT,
                               capture_output=True, text=True, timeout=60)
        assert check.returncode == 0, check.stderr
        status = json.loads(check.stdout)
        assert status.pop("started_at") > 0 and isinstance(status.pop("history"), list)
        assert status == {"service": "idle", "instance_id": service.instance_id, "phase": "serving",
                          "metrics_port": 0, "num_requests": 3}


def test_a_starting_service_is_not_healthy_yet(tmp_path, monkeypatch):
    """Its start-up phases (shared/startup.py) are written before it is on the bus: fresh,
    but the check says starting, and names the phase."""
    from shared import startup

    path = tmp_path / "heartbeat"
    monkeypatch.setenv("HEARTBEAT_FILE", str(path))
    monkeypatch.setattr(startup, "_service", None)
    monkeypatch.setattr(startup, "_history", [])
    startup.begin("worker")
    startup.phase("loading weights of m.gguf")
    startup.on_the_bus()
    startup.phase("compiling CPU kernel rms_norm")  # after start-up: only logged
    status = healthcheck.read(str(path))
    assert status["phase"] == "loading weights of m.gguf" and status["starting"]
    assert [what for what, _ in status["history"]] == ["starting the process", "loading weights of m.gguf"]
    env = {**os.environ, "HEARTBEAT_FILE": str(path), "PYTHONPATH": str(ROOT)}
    check = subprocess.run([sys.executable, "-m", "shared.healthcheck"], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 1 and "starting: loading weights of m.gguf" in check.stderr


def test_each_heartbeat_also_says_on_the_bus_what_the_service_is_and_does(tmp_path):
    import nats

    from shared.protocol import SERVICE_STATUS_CHANNEL

    async def first_status(url: str):
        nc = await nats.connect(url)
        try:
            sub = await nc.subscribe(SERVICE_STATUS_CHANNEL.subject("*"))
            return SERVICE_STATUS_CHANNEL.decode((await sub.next_msg(timeout=10)).data), sub
        finally:
            await nc.close()

    with NatsServer() as server, service_in_thread(server.url, str(tmp_path / "heartbeat")) as (service, _):
        status, _ = asyncio.run(first_status(server.url))
    assert (status.service, status.instance_id, status.phase) == ("idle", service.instance_id, "serving")
    assert status.info == {"num_requests": 3} and status.started_at > 0 and status.host


def test_stale_while_the_event_loop_is_blocked(tmp_path):
    path = str(tmp_path / "heartbeat")
    with NatsServer() as server, service_in_thread(server.url, path) as (_, loop):
        wait_until(lambda: healthy(path))
        release = threading.Event()
        loop.call_soon_threadsafe(release.wait, 30)  # a handler that never yields
        try:
            wait_until(lambda: not healthy(path))
        finally:
            release.set()
        wait_until(lambda: healthy(path))  # beating again once the loop runs
