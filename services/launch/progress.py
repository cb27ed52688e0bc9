"""What each service of a starting stack is doing, for ``scripts/serve`` to show.

The launcher gives every service process its own status file (``HEARTBEAT_FILE``): while
it starts, the service writes its phases there (``shared/startup.py``: loading weights,
compiling kernels, profiling memory...), and once on the bus its heartbeat keeps the
file up to date with its live status, whose ``phase`` is "serving" or what it waits for
(``shared/bus.py``). The file keeps every start-up phase (``history``, with its start),
so ``StartupProgress.changes()``, called now and then, returns a line for each phase
begun since its last call, however short, then one for each change of a live phase.
"""

from __future__ import annotations

import time
from pathlib import Path

from shared import healthcheck


class StartupProgress:
    def __init__(self, status_files: dict[str, str]) -> None:
        self.status_files = status_files  # service process name -> its status file
        self._shown: dict[str, tuple[int, str]] = {}  # history entries shown, last phase shown

    def _statuses(self) -> dict[str, dict]:
        return {name: healthcheck.read(path) for name, path in self.status_files.items() if Path(path).exists()}

    def phases(self) -> dict[str, str]:
        """Each service's current phase ("" before it wrote anything)."""
        return {name: status.get("phase", "") for name, status in self._statuses().items()}

    def changes(self) -> list[str]:
        """A line per phase begun since the last call: ``[<s since its start>] <name>: <phase>``."""
        lines = []
        for name, status in self._statuses().items():
            shown, last = self._shown.get(name, (0, ""))
            history = status.get("history") or []
            for what, since in history[shown:]:
                lines.append(f"[{since:6.1f}s] {name}: {what}")
                last = what
            phase = status.get("phase", "")
            if phase and phase != last:
                started = status.get("started_at")
                since = time.time() - started if started else 0.0
                lines.append(f"[{since:6.1f}s] {name}: {phase}")
                last = phase
            self._shown[name] = (len(history), last)
        return lines

    def waiting(self) -> list[str]:
        """The services not serving yet."""
        phases = self.phases()
        return [name for name in self.status_files if phases.get(name) != "serving"]
