"""scripts/gpu-check: its dry run (the CPU, Triton's interpreter, tiny shapes) runs every step
of the real run and writes the summary; a step that fails, errs or overruns is recorded and
the next still runs; the CUDA tests and the carried wheels cannot drift from the project."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path

from gpu_check import main, wheels
from gpu_check.kernel_tests import CUDA_TEST_PATHS
from gpu_check.plan import STEPS, Step

ROOT = Path(__file__).resolve().parents[2]
FAKE = "tests.scripts.gpu_check_fake_steps"


def test_dry_run_runs_every_step_and_writes_the_summary(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run([str(ROOT / "scripts" / "gpu-check"), "--dry-run", "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    # What a GPU run brings back: at most 8 files, none deeper.
    assert sorted(p.name for p in out.iterdir()) == ["gpu-check.log", "summary.json", "summary.md"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dry_run"] is True
    steps = {s["name"]: s for s in summary["steps"]}
    assert list(steps) == ["wheels", *(s.name for s in STEPS)]
    assert all(s["status"] == "passed" and not s["failures"] for s in steps.values()), steps

    kernels = steps["kernels"]["data"]
    assert kernels["counts"]["passed"] >= 15 and kernels["exit_code"] == 0
    assert all(f in kernels["by_file"] for f in ("tests/kernels/test_paged_attention.py", "tests/kernels/test_lora.py",
                                                 "tests/kernels/test_quant_linear.py"))
    bandwidth = steps["attention_bandwidth"]["data"]
    assert bandwidth["copy_gbs"] > 0 and {r["model"] for r in bandwidth["rows"]} == {
        "SmolLM2-135M", "Llama-3.2-1B", "Llama-3-8B"}
    greedy = steps["greedy"]["data"]["models"]
    assert len(greedy) == 2 and all(m["equal"] and m["preemptions"] > 0 and m["kernels"] == "triton" for m in greedy)
    services = steps["services"]["data"]
    assert services["streams"]["completed"] == 16 and services["greedy"]["equal"] == services["greedy"]["compared"] > 0
    throughput = steps["throughput"]["data"]
    assert [(r["batch"], r["sampling"]) for r in throughput["rows"]][:4] == [
        (1, "greedy"), (4, "greedy"), (4, "temperature 0.8, top_p 0.95"), (8, "greedy")]
    assert all(r["ours_tok_s"] > 0 and r["hf_tok_s"] > 0 for r in throughput["rows"])
    assert {"schedule", "forward", "sampling", "update"} <= set(throughput["step_split"]["phases_ms"])
    assert all("agreeing_tokens_median" in r for r in throughput["rows"])
    assert bandwidth["variants"] and all(r["max_abs_error"] <= 2e-2 for r in bandwidth["variants"])
    assert steps["decode_graph"]["data"]["launched_ms"] > 0
    features = steps["features"]["data"]["checks"]
    assert [c["feature"] for c in features] == ["greedy", "ngram", "structured", "logprobs", "sampled", "lora"]
    assert all(c["ok"] for c in features), features
    assert {g["goal"].split(" ")[0] for g in summary["goals"]} >= {"every", "greedy", "decode", "services", "in-process"}

    markdown = (out / "summary.md").read_text()
    assert markdown.startswith("# GPU check (DRY RUN")
    for name in steps:
        assert f"| {name} | passed |" in markdown
    assert "## Goals" in markdown and "n/a (dry run)" in markdown


def _plan_run(tmp_path, steps, budget=120.0):
    run = main.Run(out=tmp_path / "out", dry_run=True, budget_s=budget)
    run.out.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    main.run_plan(run, steps, work, None)
    return run


def test_a_failing_crashing_or_overrunning_step_is_recorded_and_the_next_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(main, "MIN_STEP_S", 1.0)
    start = time.time()
    run = _plan_run(tmp_path, (
        Step("slow", f"{FAKE}:overrun", 3, "overruns"),
        Step("failing", f"{FAKE}:fail", 30, "fails"),
        Step("crashing", f"{FAKE}:crash", 30, "raises"),
        Step("fine", f"{FAKE}:fine", 30, "passes"),
    ))
    assert time.time() - start < 40
    steps = {s["name"]: s for s in run.steps}
    assert steps["slow"]["status"] == "timeout"
    # Stopped with SIGTERM: its finally blocks ran (a services stack is stopped so).
    assert steps["slow"]["data"] == {"before_the_sleep": True, "cleaned_up": True}
    assert steps["failing"]["status"] == "failed" and steps["failing"]["failures"] == ["a mismatch"]
    assert steps["failing"]["data"] == {"figure": 1.5, "after_the_failure": True}
    assert steps["crashing"]["status"] == "error" and "ValueError: broken" in steps["crashing"]["failures"][0]
    assert steps["fine"]["status"] == "passed" and steps["fine"]["data"] == {"ok": True}
    summary = json.loads((run.out / "summary.json").read_text())
    assert [s["status"] for s in summary["steps"]] == ["timeout", "failed", "error", "passed"]
    markdown = (run.out / "summary.md").read_text()
    assert "| slow | **TIMEOUT** |" in markdown and "| crashing | **ERROR** |" in markdown
    assert "===== crashing: error =====" in (run.out / "gpu-check.log").read_text()


def test_a_step_is_skipped_once_the_budget_is_spent(tmp_path):
    run = main.Run(out=tmp_path, dry_run=True, budget_s=10.0, started=time.time() - 9.0)
    record = main.run_step(Step("fine", f"{FAKE}:fine", 30, "passes"), run, tmp_path, main.step_env(True, None))
    assert record["status"] == "skipped" and "budget" in record["failures"][0]


def test_every_test_marked_cuda_is_in_the_checks_test_paths():
    marker = re.compile(r"pytest\.mark\.cuda\b")
    marked = {path.relative_to(ROOT) for path in (ROOT / "tests").rglob("test_*.py")
              if marker.search(path.read_text())}
    assert marked
    for path in marked:
        assert any(str(path) == p or str(path).startswith(p + "/") for p in CUDA_TEST_PATHS), path


def test_the_carried_wheels_are_the_dependencies_a_gpu_machine_lacks_at_our_versions():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {wheels.normalize(dep.split(";")[0].split("=")[0].split(">")[0].split("<")[0].strip())
             for dep in project["dependencies"]}
    assert names - wheels.ON_THE_MACHINE - set(wheels.WHEELS) == set()
    for name, version in wheels.WHEELS.items():
        assert importlib.metadata.version(name) == version, name


def _summary(started: str, steps: list[tuple[str, str, dict]], goals: list[tuple[str, str, bool]]) -> dict:
    return {"dry_run": False, "started": started, "elapsed_s": 1.0, "budget_s": 420.0,
            "steps": [{"name": n, "title": n, "status": status, "seconds": 1.0, "failures": [] if status == "passed"
                       else [f"{n} broke"], "data": data} for n, status, data in steps],
            "goals": [{"goal": g, "target": "t", "measured": m, "met": met} for g, m, met in goals]}


def test_a_run_and_its_rerun_make_one_record_the_latest_step_winning():
    from gpu_check import to_record

    env = {"device_name": "NVIDIA H200", "capability": "9.0", "cpu_count": 16, "versions": {"torch": "2.11.0"}}
    first = _summary("2026-11-27T04:09:18Z", [("environment", "passed", env), ("kernels", "passed", {}),
                                               ("greedy", "error", {})],
                     [("every kernel", "120 passed", True), ("greedy", "not run", None)])
    rerun = _summary("2026-11-27T04:13:37Z", [("greedy", "passed", {"models": []})], [("greedy", "equal", True)])
    record = to_record.make_record([first, rerun], "abc1234", ["a note"], "scripts/gpu-check --out X")
    assert record.question == "gpu-check" and record.commit == "abc1234"
    assert record.date.startswith("2026-11-27T04:13:37")
    assert record.results["table"] == [
        {"goal": "every kernel", "target": "t", "measured": "120 passed", "met": "yes"},
        {"goal": "greedy", "target": "t", "measured": "equal", "met": "yes"}]
    assert record.results["targets"][0] == "a note"
    assert "greedy: passed" in record.results["targets"][1] and "broke" not in record.results["targets"][1]
    assert record.machine["cpu"].startswith("NVIDIA H200 (capability 9.0") and "torch 2.11.0" in record.machine["cpu"]
    try:
        to_record.make_record([{**first, "dry_run": True}], "abc1234", [], "")
    except ValueError as e:
        assert "dry run" in str(e)
    else:
        raise AssertionError("a dry run was recorded")
