"""Keeps a set of child processes alive: restarts one that dies, stops all on request.

The launcher (``services/launch/stack.py``) starts every service through a
``Supervisor``. A child that exits is started again with the same command after a
backoff (0.5 s, doubling up to 10 s, or the child's own cap, while it keeps dying young;
a child that ran for ``stable_after`` seconds starts over at 0.5 s), with a log line and
a count per service. Only a child that keeps dying is given up on: one that exits when it has
already been restarted ``CrashLoopBudget.restarts`` times within the last
``CrashLoopBudget.window`` seconds stays dead, and ``crash_loops()`` names it (the
launcher then stops the stack; a death it can heal never does). ``stop()`` ends
everything within its timeout: SIGTERM to each child's process group, SIGKILL to what
is left at the deadline.

Children die with the launcher even when it is SIGKILLed: each is started with the
parent-death signal set to SIGKILL (Linux ``prctl(PR_SET_PDEATHSIG)``). That signal
fires when the *thread* that started the child ends, so children are started only from
the thread that runs the supervisor for its whole life.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
BACKOFF_INITIAL = 0.5
BACKOFF_MAX = 10.0
# The crash-loop budget's defaults (the launcher's --crash-loop-restarts / --crash-loop-window):
# with the backoff above, a service that dies at once every time is given up on after ~16 s.
CRASH_LOOP_RESTARTS = 5
CRASH_LOOP_WINDOW = 60.0


@dataclass(frozen=True)
class CrashLoopBudget:
    """How many restarts within how many seconds a child may take before it is given up on."""

    restarts: int = CRASH_LOOP_RESTARTS
    window: float = CRASH_LOOP_WINDOW

    def __post_init__(self) -> None:
        if self.restarts < 0 or self.window <= 0:
            raise ValueError(f"crash-loop budget needs restarts >= 0 and window > 0, got {self}")

    def __str__(self) -> str:
        return f"{self.restarts} restarts within {self.window:g} s"


def die_with_parent(parent_pid: int):
    """A ``preexec_fn``: SIGKILL this child when its parent goes (Linux only)."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)

    def preexec() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    cwd: str
    log_path: str | None = None
    process: subprocess.Popen | None = None
    started_at: float = 0.0
    restarts: int = 0
    backoff: float = BACKOFF_INITIAL
    restart_at: float | None = None  # when a dead child is due to start again
    exit_codes: list[int] = field(default_factory=list)
    restart_times: deque = field(default_factory=deque)  # monotonic times of its restarts
    backoff_max: float | None = None  # its own cap on the backoff (None: the supervisor's)
    gave_up: bool = False  # it kept dying: its crash-loop budget is spent, it stays dead

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


class Supervisor:
    def __init__(self, stable_after: float = 30.0, backoff_max: float = BACKOFF_MAX,
                 crash_loop: CrashLoopBudget = CrashLoopBudget()) -> None:
        self.children: dict[str, Child] = {}
        self.stable_after = stable_after
        self.backoff_max = backoff_max
        self.crash_loop = crash_loop
        self.stopping = False

    def start(self, name: str, argv: list[str], env: dict[str, str], cwd: str,
              log_path: str | None = None, backoff_max: float | None = None) -> subprocess.Popen:
        child = self.children.get(name) or Child(name, argv, env, cwd, log_path, backoff_max=backoff_max)
        self.children[name] = child
        self._spawn(child)
        return child.process

    def _spawn(self, child: Child) -> None:
        # Without a log file the child logs to this terminal.
        out = open(child.log_path, "ab") if child.log_path else None
        try:
            child.process = subprocess.Popen(
                child.argv, cwd=child.cwd, env=child.env, stdout=out,
                stderr=subprocess.STDOUT if out is not None else None,
                start_new_session=True, preexec_fn=die_with_parent(os.getpid()),
            )
        finally:
            if out is not None:
                out.close()
        child.started_at = time.monotonic()
        child.restart_at = None
        child.gave_up = False

    def dead(self) -> dict[str, int]:
        """Children that exited and are not (yet) running again, with their exit codes."""
        return {c.name: c.process.returncode for c in self.children.values()
                if c.process is not None and c.process.poll() is not None}

    def crash_loops(self) -> dict[str, str]:
        """Children given up on (their crash-loop budget spent), each with why, in words."""
        return {c.name: (f"{c.name} died again after {len(c.restart_times)} restarts within "
                         f"{self.crash_loop.window:g} s (exit code {c.exit_codes[-1]}); its crash-loop budget "
                         f"is {self.crash_loop}")
                for c in self.children.values() if c.gave_up}

    def restart_counts(self) -> dict[str, int]:
        return {name: c.restarts for name, c in self.children.items()}

    def poll(self) -> list[str]:
        """Schedule and perform due restarts; returns the names started again now."""
        if self.stopping:
            return []
        now = time.monotonic()
        restarted = []
        for child in self.children.values():
            if child.process is None or child.process.poll() is None or child.gave_up:
                continue
            if child.restart_at is None:
                code = child.process.returncode
                child.exit_codes.append(code)
                while child.restart_times and child.restart_times[0] < now - self.crash_loop.window:
                    child.restart_times.popleft()
                if len(child.restart_times) >= self.crash_loop.restarts:
                    child.gave_up = True
                    logger.error("service %s exited with %s after %.1fs and keeps dying; not restarting it: %s",
                                 child.name, code, now - child.started_at, self.crash_loops()[child.name])
                    continue
                if now - child.started_at >= self.stable_after:
                    child.backoff = BACKOFF_INITIAL
                child.restart_at = now + child.backoff
                logger.warning("service %s exited with %s after %.1fs; restarting in %.1fs",
                               child.name, code, now - child.started_at, child.backoff)
                child.backoff = min(child.backoff * 2, child.backoff_max or self.backoff_max)
            if now >= child.restart_at:
                child.restarts += 1
                child.restart_times.append(now)
                self._spawn(child)
                logger.warning("service %s restarted (%d restart(s) so far)", child.name, child.restarts)
                restarted.append(child.name)
        return restarted

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to one child's process group (fault-injection tests)."""
        child = self.children[name]
        if child.alive:
            os.killpg(child.process.pid, sig)

    def stop(self, timeout: float = 8.0, spare: frozenset[str] = frozenset()) -> None:
        """SIGTERM every child, SIGKILL what is left after ``timeout`` seconds. Children
        named in ``spare`` are left running (not restarted any more): the caller stops them."""
        self.stopping = True
        running = [c.process for c in self.children.values() if c.alive and c.name not in spare]
        for process in running:
            _signal_group(process, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for process in running:
            try:
                process.wait(max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(process, signal.SIGKILL)
                process.wait()


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass
