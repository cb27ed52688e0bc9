"""The launcher as users run it (``scripts/serve``): a death it can heal never stops the
stack, a crash loop does.

A tokenizer is killed three times in a row, each time as soon as it is back: the third
death waits 2 s before its restart (the back-off doubles from 0.5 s), longer than the
launcher's 1 s look at its services, so a launcher that stopped the stack on any dead
service would stop it here (it once did). nats-server is killed too: the launcher starts
it again on its port and every service reconnects. After each, the stack serves. A fourth
death within the crash-loop window (``--crash-loop-restarts 3``) spends the budget: the
launcher stops everything and exits with status 1, naming the service and the budget.
"""

from __future__ import annotations

import os
import signal
import time

import httpx

from scripts.chaos import Launched, kind_of
from services.launch.nats_server import free_port
from tests.e2e.stacks import wait_until


def pid_of(stack: Launched, kind: str, other_than: int | None = None) -> int | None:
    pids = [pid for name, pid in stack.processes().items() if kind_of(name) == kind and pid != other_than]
    return pids[0] if pids else None


def assert_serves(stack: Launched) -> None:
    wait_until(stack.healthy, 120, "the stack is not healthy again")
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "The sea is", "max_tokens": 4, "temperature": 0}
    r = httpx.post(stack.base_url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"]


def test_deaths_heal_even_during_a_restart_backoff_and_only_a_crash_loop_stops_the_stack(tmp_path):
    stack = Launched(free_port(), ["--crash-loop-restarts", "3", "--crash-loop-window", "300"],
                     tmp_path / "launcher.log", env={"LOG_LEVEL": "WARNING"})
    try:
        stack.wait_ready()
        children = list(stack.processes().values())

        os.kill(pid_of(stack, "nats-server"), signal.SIGKILL)
        assert_serves(stack)

        pid = None
        for _ in range(3):
            wait_until(lambda: pid_of(stack, "tokenizer", other_than=pid) is not None, 60, "tokenizer not restarted")
            pid = pid_of(stack, "tokenizer", other_than=pid)
            os.kill(pid, signal.SIGKILL)
        time.sleep(1.5)  # inside the 2 s back-off: the tokenizer is dead, the stack must live on
        assert pid_of(stack, "tokenizer", other_than=pid) is None
        assert stack.process.poll() is None, stack.log_path.read_text()[-2000:]
        assert_serves(stack)

        # The fourth death within the window: a crash loop.
        os.kill(pid_of(stack, "tokenizer"), signal.SIGKILL)
        assert stack.process.wait(20) == 1
        log = stack.log_path.read_text()
        assert "crash loop: tokenizer-0 died again after 3 restarts within 300 s" in log, log[-2000:]
        assert "crash-loop budget is 3 restarts within 300 s" in log
        wait_until(lambda: not stack.processes(), 10, "services outlived the launcher")
        assert not any(os.path.exists(f"/proc/{pid}") and _running(pid) for pid in children)
    finally:
        stack.stop()


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
