"""One result record per benchmark run: what was measured, on what, by which command.

A record is a JSON file: the benchmark and the question it answers (the summary table of
docs/BENCHMARKS.md it feeds), the date, the commit (and whether the tree had changes),
the machine (CPU model and the flags that matter, cores, memory, load average, Python and
torch), the command line, the settings, and ``results``: a ``table`` (rows of the
summary: one dict per row, the columns in order) and whatever else the benchmark keeps
(every run, per-concurrency series for the plots). ``--record`` keeps it under
``docs/benchmarks/results/<question>/``, where ``scripts/bench_summary.py`` reads the
latest of each question; ``--result-file PATH`` writes it anywhere.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import ROOT
from .stats import nan_to_none

RESULTS = ROOT / "docs" / "benchmarks" / "results"
CPU_FLAGS_OF_NOTE = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")


def describe_cpu(cpuinfo: str | None = None) -> str:
    """The CPU's model name, core count and which of ``CPU_FLAGS_OF_NOTE`` it has: what
    every benchmark figure is to be read with."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    model, flags = "unknown CPU", set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            model = value.strip()
        elif key.strip() == "flags":
            flags = set(value.split())
    has = ", ".join(f"{flag} {'yes' if flag in flags else 'no'}" for flag in CPU_FLAGS_OF_NOTE)
    return f"{model}, {os.cpu_count()} logical CPUs; {has}"


def machine() -> dict:
    info = {"cpu": describe_cpu(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "load_average": round(os.getloadavg()[0], 2)}
    try:
        info["memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        pass
    if "torch" in sys.modules:
        info["torch"] = sys.modules["torch"].__version__
    isa = os.environ.get("NATSLLM_CPU_ISA")
    if isa:
        info["cpu_isa"] = isa
    return info


def commit() -> str:
    """The checkout's commit, with ``+changes`` when its tracked files differ from it."""
    def git(*args) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}+changes" if head and dirty else (head or "unknown")


def command_line() -> str:
    return " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv])


@dataclass
class Record:
    benchmark: str
    question: str
    results: dict
    config: dict = field(default_factory=dict)
    command: str = field(default_factory=command_line)
    date: str = field(default_factory=lambda: datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"))
    commit: str = field(default_factory=commit)
    machine: dict = field(default_factory=machine)
    # Records made from docs/BENCHMARKS-diary.md's prose (before the harness): where from.
    source: str = ""

    def to_json(self) -> str:
        return json.dumps(nan_to_none(asdict(self)), indent=1, allow_nan=False, default=str) + "\n"

    def file_name(self) -> str:
        return f"{self.date[:19].replace(':', '')}-{self.benchmark}.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--record", action="store_true",
                        help="keep the result record under docs/benchmarks/results/ (read by scripts/bench_summary.py)")
    parser.add_argument("--result-file", default=None, help="also write the result record here")


def save(record: Record, args: argparse.Namespace | None = None) -> list[Path]:
    """Write ``record`` where ``args`` (``add_arguments``) say; the paths written."""
    paths = []
    if args is not None and getattr(args, "result_file", None):
        paths.append(Path(args.result_file))
    if args is not None and getattr(args, "record", False):
        paths.append(RESULTS / record.question / record.file_name())
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(record.to_json())
        print(f"record written: {path}", flush=True)
    return paths


def load(path: Path) -> Record:
    return Record(**json.loads(Path(path).read_text()))


def latest(folder: Path = RESULTS) -> dict[str, Record]:
    """The newest record of each question under ``folder``."""
    newest: dict[str, Record] = {}
    for path in sorted(Path(folder).glob("*/*.json")):
        record = load(path)
        if record.question not in newest or record.date >= newest[record.question].date:
            newest[record.question] = record
    return newest
