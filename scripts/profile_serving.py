"""Where a served run's CPU goes: each service's CPU seconds, and what the worker's forward
thread does (py-spy samples), over one scripts/bench_serving.py run.

    .venv/bin/python scripts/profile_serving.py [--concurrency 32] [--num-prompts 64] \\
        [--input-len 128] [--output-len 64] [--no-py-spy] [-- serve flags, e.g. --omp-wait-policy default]

Starts the stack (``scripts/launch.py`` with ``--max-num-seqs`` = the concurrency and the
serve flags after ``--``), warms it with one short round, then runs the benchmark while
reading every service's CPU time from /proc and, unless ``--no-py-spy``, sampling the
worker with py-spy (``pip install py-spy``; a dev tool, not a project dependency) at 100 Hz,
idle samples left out. Prints the benchmark's tok/s, TTFT and TPOT, CPU seconds per
service (per second of the benchmark: 2.0 = both cores of a 2-core machine), and the
worker's active samples by the step part they fall in. py-spy's sampling costs a little
CPU itself, so compare throughput between runs made with the same flags.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")

# A sample's part of the step: the first part (in this order) with a marker in its stack.
PARTS = (
    ("logits (LM head)", ("_logits",)),
    ("decoder layers, one C call (a one-token step)", ("one_token",)),
    ("weight products (oneDNN)", ("prepacked_linear", "quantized_linear")),
    ("attention, decode (C kernel)", ("decode_attention_native",)),
    ("attention, prefill (padded SDPA)", ("_attend_group",)),
    ("attention, other", ("paged_attention",)),
    ("RMSNorm, rotary + KV write, SiLU (C kernels)", ("rms_norm", "rotary_write_kv", "silu_and_mul")),
    ("sampling", ("Sampler.__call__", "make_sampling_metadata")),
    ("model glue (embedding, module calls, splits)", ("CausalLM.forward",)),
    ("batch update, inputs, output (Python)", ("execute_model",)),
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children")
    out = []
    for child in (int(c) for c in children.read_text().split()) if children.exists() else ():
        out += [child, *descendants(child)]
    return out


def service_name(pid: int) -> str:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    for i, arg in enumerate(argv):
        if arg == b"-m" and i + 1 < len(argv):
            return argv[i + 1].decode().removeprefix("services.")
    return Path(argv[0].decode()).name


def cpu_seconds(pids: list[int]) -> dict[int, float]:
    """user + system CPU seconds of each live pid."""
    out = {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        out[pid] = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    return out


def bench(port: int, args, num_prompts: int, output_len: int, result_file: str | None) -> None:
    cmd = [PYTHON, str(ROOT / "scripts/bench_serving.py"), "--base-url", f"http://127.0.0.1:{port}",
           "--endpoint", "completions", "--num-prompts", str(num_prompts), "--max-concurrency",
           str(args.concurrency), "--input-len", str(args.input_len), "--output-len", str(output_len),
           "--seed", "0", "--timeout", "900", "--wait-for-server", "300"]
    if result_file:
        cmd += ["--result-file", result_file]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def step_part(stack: list[str]) -> str | None:
    """The part of the step a forward-thread stack (outermost first) is in, None when the
    thread is not in a step."""
    if not any("execute_model" in frame for frame in stack):
        return None
    for name, markers in PARTS:
        if any(marker in frame for frame in stack for marker in markers):
            return name
    return "other"


def read_py_spy(path: Path) -> Counter:
    parts: Counter = Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if any("concurrent/futures/thread.py" in frame for frame in frames):  # the forward thread
            parts[step_part(frames) or "forward thread, between steps"] += int(count)
        else:
            parts["event loop thread (bus, step messages)"] += int(count)
    return parts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--no-py-spy", action="store_true")
    p.add_argument("serve_args", nargs="*", help="flags for scripts/launch.py (after --)")
    args = p.parse_args()
    py_spy = None if args.no_py_spy else shutil.which("py-spy", path=str(Path(PYTHON).parent)) or shutil.which("py-spy")
    if not args.no_py_spy and py_spy is None:
        p.error("py-spy not found (pip install py-spy, or --no-py-spy)")
    port = free_port()
    work = Path(tempfile.mkdtemp(prefix="profile-serving-"))
    log = open(work / "serve.log", "w")
    stack = subprocess.Popen([PYTHON, str(ROOT / "scripts/launch.py"), "--port", str(port), "--max-num-seqs",
                              str(args.concurrency), *args.serve_args], stdout=log, stderr=subprocess.STDOUT,
                             cwd=ROOT, start_new_session=True)
    try:
        bench(port, args, args.concurrency, 8, None)  # warm-up: kernels built, shapes seen
        pids = [stack.pid, *descendants(stack.pid)]
        names = {pid: service_name(pid) for pid in pids}
        worker = next(pid for pid, name in names.items() if name == "worker")
        sampler = None
        if py_spy:
            sampler = subprocess.Popen([py_spy, "record", "-p", str(worker), "-r", "100", "-f", "raw",
                                        "-o", str(work / "worker.txt"), "--nonblocking"],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        before, load = cpu_seconds(pids), os.getloadavg()[0]
        bench(port, args, args.num_prompts, args.output_len, str(work / "result.json"))
        after = cpu_seconds(pids)
        if sampler:
            sampler.send_signal(signal.SIGINT)
            sampler.wait(timeout=60)
    finally:
        os.killpg(stack.pid, signal.SIGTERM)
        stack.wait(timeout=60)
    metrics = json.loads((work / "result.json").read_text())["results"]["metrics"]
    # The stack idles while the benchmark process starts and ends: CPU per second of its run.
    duration = metrics["duration_s"]
    print(f"load average {load:.1f} -> {os.getloadavg()[0]:.1f}; {args.serve_args or 'defaults'}")
    print(f"output {metrics['output_throughput']:.1f} tok/s, median TTFT {metrics['ttft_ms']['median']:.0f} ms, "
          f"median TPOT {metrics['tpot_ms']['median']:.1f} ms, in {duration:.2f} s")
    print("| service | CPU s | CPU s per benchmark s |\n|---|---:|---:|")
    by_service: Counter = Counter()
    for pid, seconds in after.items():
        by_service[names[pid]] += seconds - before.get(pid, 0.0)
    for name, seconds in by_service.most_common():
        print(f"| {name} | {seconds:.2f} | {seconds / duration:.2f} |")
    if sampler and (work / "worker.txt").exists():
        parts = read_py_spy(work / "worker.txt")
        forward = sum(n for part, n in parts.items() if not part.startswith("event loop"))
        print("| worker: forward thread, active samples | share |\n|---|---:|")
        for part, n in parts.most_common():
            if not part.startswith("event loop"):
                print(f"| {part} | {n / forward:.1%} |")
        print(f"event loop thread active: {parts['event loop thread (bus, step messages)'] / max(forward, 1):.1%} "
              f"of the forward thread's active samples")
    print(f"logs and raw samples in {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
