"""One step of the GPU check in its own process, and the context a step runs with.

    python scripts/gpu_check/step.py MODULE --result FILE --work DIR --deadline EPOCH [--dry-run]

imports ``MODULE`` (e.g. ``gpu_check.greedy``) and calls its ``run(ctx)`` (``MODULE:NAME``: its
``NAME(ctx)``). Whatever the step
records goes to ``FILE`` at once (JSON: ``status``, ``failures``, ``data``), so the check
reads what a step had found even when the step is stopped at its time limit. A step records
a mismatch as a failure and goes on (``ctx.fail``); an exception ends it as an error.
"""

from __future__ import annotations

import argparse
import importlib
import json
import signal
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class StepContext:
    """What a step knows (dry run or not, the shared scratch folder, its deadline) and how
    it reports (``record``, ``fail``): every call rewrites the result file."""

    def __init__(self, result_file: Path, work: Path, deadline: float, dry_run: bool) -> None:
        self.result_file = result_file
        self.work = work
        self.deadline = deadline
        self.dry_run = dry_run
        self.status = "running"
        self.failures: list[str] = []
        self.data: dict = {}
        self._write()

    @property
    def device(self) -> str:
        """Where the step runs: the GPU, or the CPU in a dry run."""
        return "cpu" if self.dry_run else "cuda"

    def seconds_left(self) -> float:
        return self.deadline - time.time()

    def record(self, key: str, value) -> None:
        self.data[key] = value
        self._write()

    def append(self, key: str, value) -> None:
        self.data.setdefault(key, []).append(value)
        self._write()

    def fail(self, message: str) -> None:
        print(f"FAILED: {message}", flush=True)
        self.failures.append(message)
        self._write()

    def finish(self, status: str) -> None:
        self.status = status
        self._write()

    def _write(self) -> None:
        tmp = self.result_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"status": self.status, "failures": self.failures, "data": self.data},
                                  default=str))
        tmp.replace(self.result_file)


def require_cuda(ctx: StepContext) -> None:
    """A real run needs the GPU: stop the step at once where there is none."""
    import torch

    if not ctx.dry_run and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device (use --dry-run on a machine without one)")


def _stop_on_sigterm(signum, frame):
    # The check's time limit: raise, so that finally blocks (a stack's stop) run.
    raise SystemExit(f"stopped by signal {signum} (the step's time limit)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("module")
    parser.add_argument("--result", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--deadline", type=float, required=True)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    ctx = StepContext(args.result, args.work, args.deadline, args.dry_run)
    try:
        module, _, function = args.module.partition(":")
        getattr(importlib.import_module(module), function or "run")(ctx)
    except BaseException as exc:  # SystemExit from the time limit included: record, then end
        traceback.print_exc()
        ctx.fail(f"{type(exc).__name__}: {exc}"[:2000])
        ctx.finish("error")
        return 1
    ctx.finish("failed" if ctx.failures else "passed")
    return 0


if __name__ == "__main__":
    for path in (ROOT / "scripts", ROOT):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    sys.exit(main())
