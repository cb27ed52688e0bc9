"""The GPU check's summary: the goals (target against measured) and the markdown.

Each step module renders its own part: ``summary(data)`` (one line), ``section(data)``
(markdown lines) and ``goals(data, dry_run)`` (``goal`` dicts). Nothing here may stop the
check: a part that cannot be rendered from what a step left says so instead.
"""

from __future__ import annotations

import importlib

from gpu_check.plan import MODULES


def goal(name: str, target: str, measured: str, met: bool | None) -> dict:
    """One goal of the issue: ``met`` None where nothing was measured (or a dry run's
    figures, which mean nothing)."""
    return {"goal": name, "target": target, "measured": measured, "met": met}


def _render(record: dict, function: str, *args):
    """The step module's ``function`` of what the step recorded; None where the module has
    none, the exception where it failed on a partial result."""
    name = MODULES.get(record["name"])
    render = getattr(importlib.import_module(name), function, None) if name else None
    if render is None:
        return None
    try:
        return render(record.get("data") or {}, *args)
    except Exception as exc:  # a partial result may lack anything
        return exc


def step_line(record: dict) -> str:
    if record.get("failures"):
        first = str(record["failures"][0]).strip().splitlines()
        more = len(record["failures"]) - 1
        return (first[0] if first else "") + (f" (and {more} more)" if more > 0 else "")
    line = _render(record, "summary")
    return f"(cannot render: {line!r})" if isinstance(line, Exception) else (line or "")


def goals(summary: dict) -> list[dict]:
    found = []
    for record in summary["steps"]:
        step_goals = _render(record, "goals", summary["dry_run"])
        if isinstance(step_goals, list):
            found += step_goals
    return found


def _met(value: bool | None, dry_run: bool) -> str:
    if value is None:
        return "n/a (dry run)" if dry_run else "not measured"
    return "**yes**" if value else "**NO**"


def markdown(summary: dict) -> str:
    dry = summary["dry_run"]
    env = next((s.get("data", {}) for s in summary["steps"] if s["name"] == "environment"), {})
    device = env.get("device_name") or ("CPU, Triton's interpreter" if dry else "unknown device")
    lines = [f"# GPU check{' (DRY RUN: CPU, tiny shapes; figures mean nothing)' if dry else ''}: {device}", ""]
    if env.get("versions"):
        lines += [", ".join(f"{k} {v}" for k, v in env["versions"].items()), ""]
    passed = sum(s["status"] == "passed" for s in summary["steps"])
    lines += [f"Started {summary['started']}, {summary['elapsed_s']} s of a {summary['budget_s']:.0f} s budget; "
              f"{passed} of {len(summary['steps'])} steps passed.", "",
              "| step | status | s | summary |", "|---|---|---|---|"]
    for s in summary["steps"]:
        status = s["status"] if s["status"] == "passed" else f"**{s['status'].upper()}**"
        lines.append(f"| {s['name']} | {status} | {s['seconds']} | {_cell(step_line(s))} |")
    if summary.get("goals"):
        lines += ["", "## Goals", "", "| goal | target | measured | met |", "|---|---|---|---|"]
        for g in summary["goals"]:
            lines.append(f"| {g['goal']} | {g['target']} | {_cell(g['measured'])} | {_met(g['met'], dry)} |")
    for s in summary["steps"]:
        body = _render(s, "section") or []
        if isinstance(body, Exception):
            body = [f"(cannot render: {body!r})"]
        failures = s.get("failures") or []
        if not body and not failures:
            continue
        lines += ["", f"## {s['name']}: {s['title']}", ""]
        if failures:
            lines += ["Failures:", ""] + [f"- {_cell(f, 600)}" for f in failures] + [""]
        lines += body
    return "\n".join(lines) + "\n"


def _cell(text, limit: int = 300) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 3] + "..."
