"""Decode throughput of the in-process engine, quiet and beside a busy process, under an
OpenMP wait policy: how much a competing process costs the worker's OpenMP threads.

    .venv/bin/python scripts/bench_cpu_contention.py                  # default policy
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python scripts/bench_cpu_contention.py

Runs the same greedy workload (8 requests, 64 prompt tokens, 32 output tokens, prefix
caching off) twice: alone, then with one busy-looping process beside it; prints output
tok/s for both and their ratio. The policy is read by OpenMP at start, so compare
policies by running the script once per policy.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench import record  # noqa: E402
from bench.engines import engine as make_engine  # noqa: E402

NUM_REQUESTS, PROMPT_LEN, OUTPUT_LEN = 8, 64, 32


def main() -> None:
    from shared.protocol import SamplingParams

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Other flags go to the engine, as scripts/serve's.")
    record.add_arguments(parser)
    args, engine_flags = parser.parse_known_args()
    engine = make_engine([*engine_flags, "--no-enable-prefix-caching"], max_num_seqs=16, cpu_kv_cache_gib=0.25)
    rng = random.Random(0)
    engine.generate([[rng.randrange(100, 40000) for _ in range(32)]], SamplingParams(max_tokens=4, temperature=0))

    def tok_s() -> float:
        prompts = [[rng.randrange(100, 40000) for _ in range(PROMPT_LEN)] for _ in range(NUM_REQUESTS)]
        start = time.perf_counter()
        engine.generate(prompts, SamplingParams(max_tokens=OUTPUT_LEN, temperature=0, ignore_eos=True))
        return NUM_REQUESTS * OUTPUT_LEN / (time.perf_counter() - start)

    quiet = tok_s()
    busy_loop = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        busy = tok_s()
    finally:
        busy_loop.kill()
        busy_loop.wait()
    policy = os.environ.get("OMP_WAIT_POLICY", "default")
    print(f"OMP_WAIT_POLICY={policy}: quiet {quiet:.1f} tok/s, beside a busy process {busy:.1f} tok/s "
          f"({busy / quiet:.2f}x), {os.cpu_count()} CPUs")
    table = [{"OMP_WAIT_POLICY": policy, "quiet tok/s": quiet, "beside a busy process tok/s": busy,
              "busy/quiet": busy / quiet}]
    record.save(record.Record("cpu_contention", "cpu-contention", config={"engine_flags": engine_flags},
                              results={"table": table}), args)


if __name__ == "__main__":
    main()
