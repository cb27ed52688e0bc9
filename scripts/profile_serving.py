"""Where a served run's CPU goes: each service's CPU seconds (and the client's), and what the
worker's forward thread does (py-spy samples), over one benchmark client run.

    .venv/bin/python scripts/profile_serving.py [--concurrency 32] [--num-prompts 64] \\
        [--input-len 128] [--output-len 64] [--client ours|vllm] [--sampling greedy|default] \\
        [--no-py-spy] [-- serve flags, e.g. --omp-wait-policy default]

``--client ours`` is scripts/bench_serving.py; ``--client vllm`` is vLLM's own `bench serve`
(random-token prompts, ``--ignore-eos``) from build/vllm-venv, as scripts/bench_peers.sh runs
it; its per-request prompt lengths are what our server counted (``usage.prompt_tokens``).
``--sampling default`` sends no temperature (the server's default: temperature 1), greedy 0.
The client's own CPU seconds are counted too (it shares the machine's cores).

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

from bench.client import prefix_cache_counts as served_prefix_cache_counts
from bench.vllm_client import HF_TOKENIZER, VLLM_VENV

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")

# A sample's part of the step: the first part (in this order) with a marker in its stack.
PARTS = (
    ("logits (LM head)", ("_logits", "compute_logits")),
    ("decoder layers, one C call (a one-token step)", ("one_token",)),
    ("weight products (oneDNN)", ("prepacked_linear",)),
    ("weight products (int8 activations, C)", ("int8_activations.py",)),
    ("weight products (other)", ("quantized_linear", "dense_linear")),
    ("attention, per token (C decode kernel)", ("decode_attention_native",)),
    ("attention, prefill (C kernel)", ("_run_prefill_kernel",)),
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


# Each client's load run wrapped to write its process's CPU seconds (all threads) over the run
# alone, not its start-up (imports, tokenizer, dataset), to $CLIENT_CPU_FILE.
TIMED = """
import functools, os, time
def timed(run):
    @functools.wraps(run)
    async def wrapper(*args, **kwargs):
        start = time.process_time()
        try:
            return await run(*args, **kwargs)
        finally:
            with open(os.environ["CLIENT_CPU_FILE"], "w") as f:
                f.write(str(time.process_time() - start))
    return wrapper
"""
VLLM_BENCH = TIMED + """
import sys
import vllm.benchmarks.serve as serve
from vllm.utils.argparse_utils import FlexibleArgumentParser
serve.benchmark = timed(serve.benchmark)
parser = FlexibleArgumentParser()
serve.add_cli_args(parser)
serve.main(parser.parse_args(sys.argv[1:]))
"""
OUR_BENCH = TIMED + """
import sys
sys.path.insert(0, sys.argv.pop(1))
import bench_serving
bench_serving.run_load = timed(bench_serving.run_load)
sys.exit(bench_serving.main(sys.argv[1:]))
"""


def prefix_cache_counts(port: int) -> dict[str, float]:
    """The prefix cache's queried and hit tokens so far, once the engines' next stats are in."""
    import time

    time.sleep(1.5)  # the engines' stats come once a second
    return served_prefix_cache_counts(f"http://127.0.0.1:{port}")


def bench(port: int, args, num_prompts: int, output_len: int, result_file: str | None, seed: int) -> None:
    """One run of our client (always: the warm-up) or, with ``result_file`` and ``--client vllm``,
    of vLLM's; its result in bench_serving's form at ``result_file``."""
    if args.client == "vllm" and result_file:
        return bench_vllm(port, args, num_prompts, output_len, result_file, seed)
    cmd = [PYTHON, "-c", OUR_BENCH, str(ROOT / "scripts"), "--base-url", f"http://127.0.0.1:{port}",
           "--endpoint", "completions", "--num-prompts", str(num_prompts), "--max-concurrency",
           str(args.concurrency), "--input-len", str(args.input_len), "--output-len", str(output_len),
           "--seed", str(seed), "--timeout", "900", "--wait-for-server", "300",
           "--temperature", "default" if args.sampling == "default" else "0"]
    if result_file:
        cmd += ["--result-file", result_file]
    cpu_file = str(Path(result_file).with_suffix(".client-cpu")) if result_file else os.devnull
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "CLIENT_CPU_FILE": cpu_file})


def bench_vllm(port: int, args, num_prompts: int, output_len: int, result_file: str, seed: int) -> None:
    from bench.client import served_model
    from bench.peers import from_vllm_bench

    model = served_model(f"http://127.0.0.1:{port}")
    raw = Path(result_file).with_suffix(".vllm.json")
    cmd = [str(VLLM_VENV / "bin/python"), "-c", VLLM_BENCH, "--backend", "openai", "--base-url",
           f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions", "--model", model, "--served-model-name",
           model, "--tokenizer", str(HF_TOKENIZER), "--dataset-name", "random", "--random-input-len",
           str(args.input_len), "--random-output-len", str(output_len), "--num-prompts", str(num_prompts),
           "--max-concurrency", str(args.concurrency), "--ignore-eos", "--seed", str(seed), "--num-warmups", "1",
           "--disable-tqdm", "--save-result", "--save-detailed", "--result-dir", str(raw.parent),
           "--result-filename", raw.name]
    if args.sampling == "greedy":
        cmd += ["--temperature", "0"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "CLIENT_CPU_FILE": str(Path(result_file).with_suffix(".client-cpu"))}
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
    result = json.loads(raw.read_text())
    if result["failed"]:
        raise SystemExit(f"{result['failed']} of vLLM's client's requests failed: {result['errors'][:2]}")
    record = from_vllm_bench(result, "ours")
    record["results"]["metrics"]["duration_s"] = result["duration"]
    lens = result.get("input_lens") or []
    if lens:
        print(f"prompt tokens our server counted (vLLM's client asked for {args.input_len}): "
              f"min {min(lens)}, mean {sum(lens) / len(lens):.1f}, max {max(lens)}")
    Path(result_file).write_text(json.dumps(record))


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
    p.add_argument("--client", choices=("ours", "vllm"), default="ours")
    p.add_argument("--sampling", choices=("greedy", "default"), default="greedy")
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
        # Warm-up (kernels built, shapes seen) with prompts of its own: no prefix-cache hit later.
        bench(port, args, args.concurrency, 8, None, seed=1000)
        pids = [stack.pid, *descendants(stack.pid)]
        names = {pid: service_name(pid) for pid in pids}
        worker = next(pid for pid, name in names.items() if name == "worker")
        sampler = None
        if py_spy:
            sampler = subprocess.Popen([py_spy, "record", "-p", str(worker), "-r", "100", "-f", "raw",
                                        "-o", str(work / "worker.txt"), "--nonblocking"],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        cache_before = prefix_cache_counts(port)
        before, load = cpu_seconds(pids), os.getloadavg()[0]
        bench(port, args, args.num_prompts, args.output_len, str(work / "result.json"), seed=0)
        after = cpu_seconds(pids)
        cache_after = prefix_cache_counts(port)
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
    queried = cache_after["queries"] - cache_before["queries"]
    print(f"prefix cache: {cache_after['hits'] - cache_before['hits']:.0f} of {queried:.0f} prompt tokens hit")
    output_tokens = args.num_prompts * args.output_len  # every request runs to its length
    print(f"| process | CPU s | CPU s per benchmark s | CPU ms per output token |\n|---|---:|---:|---:|")
    by_service: Counter = Counter()
    for pid, seconds in after.items():
        by_service[names[pid]] += seconds - before.get(pid, 0.0)
    by_service[f"client ({args.client}, its load run)"] = float((work / "result.client-cpu").read_text())
    for name, seconds in [*by_service.most_common(), ("total", sum(by_service.values()))]:
        print(f"| {name} | {seconds:.2f} | {seconds / duration:.2f} | {seconds / output_tokens * 1000:.3f} |")
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
