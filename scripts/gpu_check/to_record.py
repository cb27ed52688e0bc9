"""A real GPU check's summaries as one benchmark record: the "Triton kernels on a GPU"
section of docs/BENCHMARKS.md (question ``gpu-check``).

    .venv/bin/python scripts/gpu_check/to_record.py --commit C [--note TEXT ...] SUMMARY.json [SUMMARY.json ...]

Run here, on the summary.json files a GPU run brought back (the device tool's files_at),
oldest first: a first run and its reruns of some steps make one record, a step's latest
run and a goal's latest figure winning. Then ``scripts/bench_summary.py`` makes the page.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for _path in (ROOT / "scripts", ROOT):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from bench.record import RESULTS, Record  # noqa: E402

QUESTION = "gpu-check"


def merge(summaries: list[dict]) -> tuple[dict[str, dict], dict[str, dict]]:
    """(steps by name, goals by name), each the latest summary's that ran it."""
    steps: dict[str, dict] = {}
    goals: dict[str, dict] = {}
    for summary in summaries:
        if summary.get("dry_run"):
            raise ValueError("a dry run's figures mean nothing: record only a real GPU run")
        steps.update({step["name"]: step for step in summary["steps"]})
        goals.update({goal["goal"]: goal for goal in summary["goals"]})
    return steps, goals


def device_line(env: dict) -> str:
    """The GPU and the software it ran, from the environment step's data."""
    versions = ", ".join(f"{name} {version}" for name, version in env.get("versions", {}).items())
    return (f"{env.get('device_name', 'unknown GPU')} (capability {env.get('capability')}, {env.get('memory_gib')} GiB, "
            f"{env.get('multiprocessors')} SMs, L2 {env.get('l2_mib')} MiB, driver {env.get('driver')}), "
            f"{env.get('cpu_count')} CPU cores; {versions}")


def make_record(summaries: list[dict], commit: str, notes: list[str], command: str) -> Record:
    steps, goals = merge(summaries)
    env = steps.get("environment", {}).get("data", {})
    table = [{"goal": g["goal"], "target": g["target"], "measured": g["measured"],
              "met": "yes" if g["met"] else ("not measured" if g["met"] is None else "NO")} for g in goals.values()]
    step_lines = [f"{name}: {step['status']} ({step.get('seconds')} s)"
                  + (f", first failure: {step['failures'][0]}" if step.get("failures") else "")
                  for name, step in steps.items()]
    return Record(
        benchmark="gpu-check", question=QUESTION,
        results={"table": table, "targets": [*notes, "Steps, each as its latest run ended: " + "; ".join(step_lines)],
                 "steps": {name: step.get("data", {}) for name, step in steps.items()}},
        command=command, date=summaries[-1]["started"].replace("Z", "+00:00"), commit=commit,
        machine={"cpu": device_line(env), "cpus": env.get("cpu_count")},
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("summaries", nargs="+", type=Path, help="summary.json files, oldest first")
    parser.add_argument("--commit", required=True, help="the commit the GPU ran (with its changes, say so)")
    parser.add_argument("--note", action="append", default=[], help="a line to print under the table")
    parser.add_argument("--command", default="scripts/gpu-check --out $OUT/gpu   # the device tool's run, "
                                              "carry [\".whl\"]; reruns with --only")
    args = parser.parse_args(argv)
    summaries = [json.loads(path.read_text()) for path in args.summaries]
    record = make_record(summaries, args.commit, args.note, args.command)
    path = RESULTS / QUESTION / record.file_name()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(record.to_json())
    print(f"record written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
