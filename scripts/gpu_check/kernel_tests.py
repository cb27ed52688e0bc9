"""The check's kernel step: the project's CUDA tests (``pytest -m cuda``) on the GPU.

They compare every Triton kernel with its PyTorch reference in float32, bfloat16 and
float16 where the kernel takes them, on shapes that span several blocks, with GQA and
chunked prefill mixed with decodes (their shapes grow when CUDA is there; a dry run runs
them under Triton's interpreter, one case of each test: CI's suite runs them all). Each outcome is recorded as it comes
(``pytest_outcomes``), so a run cut short still says what passed. With pytest-xdist
installed (the GPU machines have it) the tests run in several processes, which mostly
shortens the Triton compiles.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from gpu_check.step import ROOT, StepContext, require_cuda

# Every file that holds a test marked cuda (tests/scripts/test_gpu_check.py keeps this true);
# only these are collected: other test modules import packages a GPU machine may lack.
CUDA_TEST_PATHS = (
    "tests/kernels", "tests/worker/test_kv_transfer.py",
    "tests/worker/test_kv_offload_worker.py",
)
MAX_XDIST_WORKERS = 8
OUTPUT_TAIL_LINES = 40


def _xdist_workers(ctx: StepContext) -> int:
    if ctx.dry_run or importlib.util.find_spec("xdist") is None:
        return 0
    return min(MAX_XDIST_WORKERS, os.cpu_count() or 1)


def run(ctx: StepContext) -> None:
    require_cuda(ctx)
    outcomes_file = ctx.work / "kernel-outcomes.jsonl"
    outcomes_file.unlink(missing_ok=True)
    command = [sys.executable, "-m", "pytest", "-m", "cuda and not slow", *CUDA_TEST_PATHS, "-q", "-rfE",
               "-p", "no:cacheprovider", "-p", "gpu_check.pytest_outcomes", "--durations=10"]
    workers = _xdist_workers(ctx)
    if workers:
        command += ["-n", str(workers)]
    ctx.record("command", " ".join(command[1:]))
    # No CPU kernel is under test here: none is compiled (test modules probe for them).
    env = dict(os.environ, GPU_CHECK_OUTCOMES=str(outcomes_file), NATSLLM_NATIVE_KERNELS="0",
               GPU_CHECK_ONE_CASE="1" if ctx.dry_run else "0")
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    tail = collections.deque(maxlen=OUTPUT_TAIL_LINES)
    timer = _Deadline(proc, ctx.seconds_left() - 10)
    try:
        for line in proc.stdout:
            print(line, end="", flush=True)
            tail.append(line.rstrip())
        proc.wait()
    finally:  # this step stopped at its own limit too: pytest (its own session) goes with it
        timer.cancel()
        if proc.poll() is None:
            timer.stop()
    tally = _tally(outcomes_file)
    ctx.record("exit_code", proc.returncode)
    ctx.record("counts", tally["counts"])
    ctx.record("by_file", tally["by_file"])
    ctx.record("slowest", tally["slowest"])
    for failure in tally["failures"]:
        ctx.fail(f"{failure['test']}: {_last_line(failure.get('message', ''))}")
    if timer.fired:
        ctx.fail(f"pytest stopped at the step's time limit after {sum(tally['counts'].values())} tests")
    elif proc.returncode != 0 and not tally["failures"]:
        ctx.fail(f"pytest exited with {proc.returncode}: " + " / ".join(list(tail)[-5:]))
    elif tally["counts"].get("passed", 0) == 0:
        ctx.fail("no CUDA test passed")


class _Deadline:
    """Stops a process group once ``seconds`` have passed."""

    def __init__(self, proc: subprocess.Popen, seconds: float) -> None:
        import threading

        self.fired = False
        self._proc = proc
        self._timer = threading.Timer(max(1.0, seconds), self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        self.fired = True
        self.stop()

    def stop(self) -> None:
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def cancel(self) -> None:
        self._timer.cancel()


def _tally(path: Path) -> dict:
    counts: collections.Counter = collections.Counter()
    by_file: dict[str, collections.Counter] = {}
    failures, durations = [], []
    if path.exists():
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            counts[entry["outcome"]] += 1
            by_file.setdefault(entry["test"].split("::")[0], collections.Counter())[entry["outcome"]] += 1
            durations.append((entry["seconds"], entry["test"]))
            if entry["outcome"] in ("failed", "error"):
                failures.append(entry)
    return {"counts": dict(counts), "by_file": {f: dict(c) for f, c in sorted(by_file.items())},
            "failures": failures, "slowest": [f"{t} ({s} s)" for s, t in sorted(durations, reverse=True)[:5]]}


def _last_line(message: str) -> str:
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    # pytest's long report ends with the file:line of the failure; the error is just above.
    errors = [line for line in lines if line.startswith("E ")]
    return (errors[-1] if errors else lines[-1] if lines else "")[:500]


def summary(data: dict) -> str:
    counts = data.get("counts", {})
    return ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items())) or "no test ran"


def section(data: dict) -> list[str]:
    lines = [f"`{data.get('command', '')}`", "", "| test file | passed | failed | error | skipped |", "|---|---|---|---|---|"]
    for name, counts in data.get("by_file", {}).items():
        lines.append(f"| {name} | {counts.get('passed', 0)} | {counts.get('failed', 0)} | {counts.get('error', 0)} "
                     f"| {counts.get('skipped', 0)} |")
    if data.get("slowest"):
        lines += ["", "Slowest: " + "; ".join(data["slowest"])]
    return lines


def goals(data: dict, dry_run: bool) -> list[dict]:
    from gpu_check.report import goal

    counts = data.get("counts")
    if counts is None:
        return [goal("every kernel equal to its reference", "0 failed", "not run", None)]
    bad = counts.get("failed", 0) + counts.get("error", 0)
    ok = bad == 0 and counts.get("passed", 0) > 0 and data.get("exit_code") == 0
    return [goal("every kernel equal to its reference", "0 failed", summary(data), ok)]
