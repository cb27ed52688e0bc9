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

import os
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

NUM_REQUESTS, PROMPT_LEN, OUTPUT_LEN = 8, 64, 32


def main() -> None:
    from services.engine import Engine
    from shared.config import CacheConfig, SchedulerConfig
    from shared.protocol import SamplingParams

    engine = Engine(scheduler_config=SchedulerConfig(max_num_seqs=16),
                    cache_config=CacheConfig(cpu_kv_cache_gib=0.25, enable_prefix_caching=False))
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


if __name__ == "__main__":
    main()
