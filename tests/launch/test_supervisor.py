"""The launcher's supervisor with real child processes: restart with backoff, a crash-loop
budget that gives up only on a child that keeps dying, stop within its timeout, and
children that die with a SIGKILLed launcher."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from services.launch.supervisor import CrashLoopBudget, Supervisor

ROOT = Path(__file__).resolve().parents[2]
SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


def until(predicate, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)
    return value


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not reaped by its dead parent's reaper yet) counts as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_a_dead_child_is_restarted_with_backoff_and_counted():
    sup = Supervisor()
    try:
        first = sup.start("sleeper", SLEEPER, dict(os.environ), str(ROOT))
        sup.kill("sleeper")
        first.wait()
        assert sup.dead() == {"sleeper": -signal.SIGKILL}
        assert sup.poll() == []  # not before the backoff
        restarted = until(lambda: sup.poll(), timeout=5)
        assert restarted == ["sleeper"] and sup.restart_counts() == {"sleeper": 1}
        second = sup.children["sleeper"].process
        assert second.pid != first.pid and second.poll() is None and sup.dead() == {}
        # Dying young again doubles the wait.
        assert sup.children["sleeper"].backoff == 1.0
    finally:
        sup.stop()


def test_a_child_that_keeps_dying_spends_its_crash_loop_budget_and_stays_dead():
    sup = Supervisor(crash_loop=CrashLoopBudget(restarts=2, window=60))
    try:
        sup.start("crasher", [sys.executable, "-c", "raise SystemExit(3)"], dict(os.environ), str(ROOT))
        sup.start("sleeper", SLEEPER, dict(os.environ), str(ROOT))
        # Restarted after 0.5 s and 1 s; the third exit within the window spends the budget.
        until(lambda: sup.poll() is not None and sup.crash_loops(), timeout=10)
        assert sup.restart_counts() == {"crasher": 2, "sleeper": 0}
        [why] = sup.crash_loops().values()
        assert "crasher" in why and "exit code 3" in why and "2 restarts within 60 s" in why
        time.sleep(1.5)
        assert sup.poll() == [] and sup.restart_counts()["crasher"] == 2  # given up on: no more restarts
        assert sup.children["sleeper"].alive
    finally:
        sup.stop()


def test_a_child_may_cap_its_own_backoff():
    sup = Supervisor()
    try:
        sup.start("bus", [sys.executable, "-c", "raise SystemExit(1)"], dict(os.environ), str(ROOT), backoff_max=0.5)
        until(lambda: sup.poll() is not None and sup.restart_counts()["bus"] >= 3, timeout=10)
        assert sup.children["bus"].backoff == 0.5  # not 1, 2, 4 s
    finally:
        sup.stop()


def test_deaths_further_apart_than_the_window_never_spend_the_budget():
    sup = Supervisor(crash_loop=CrashLoopBudget(restarts=1, window=0.3))
    try:
        sup.start("slow-crasher", [sys.executable, "-c", "import time; time.sleep(0.6)"], dict(os.environ), str(ROOT))
        until(lambda: sup.poll() is not None and sup.restart_counts()["slow-crasher"] >= 3, timeout=20)
        assert sup.crash_loops() == {}
    finally:
        sup.stop()


def test_stop_ends_everything_within_its_timeout_even_a_child_ignoring_sigterm(tmp_path):
    stubborn = [sys.executable, "-c",
                "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(120)"]
    sup = Supervisor()
    sup.start("polite", SLEEPER, dict(os.environ), str(ROOT))
    log = tmp_path / "stubborn.log"
    process = sup.start("stubborn", stubborn, dict(os.environ), str(ROOT), log_path=str(log))
    until(lambda: log.exists() and "up" in log.read_text())  # its SIGTERM handler is installed
    start = time.monotonic()
    sup.stop(timeout=1.0)
    assert time.monotonic() - start < 3.0
    assert process.returncode == -signal.SIGKILL
    assert sup.children["polite"].process.returncode == -signal.SIGTERM
    assert sup.poll() == []  # nothing restarts once stopping


def test_children_die_with_a_sigkilled_launcher(tmp_path):
    script = textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from services.launch.supervisor import CrashLoopBudget, Supervisor
        sup = Supervisor()
        for name in ("a", "b"):
            p = sup.start(name, {SLEEPER!r}, dict(os.environ), {str(ROOT)!r})
            print(p.pid, flush=True)
        time.sleep(120)
    """)
    launcher = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    pids = [int(launcher.stdout.readline()) for _ in range(2)]
    assert all(pid_alive(pid) for pid in pids)
    launcher.kill()
    launcher.wait()
    until(lambda: not any(pid_alive(pid) for pid in pids), timeout=5)
