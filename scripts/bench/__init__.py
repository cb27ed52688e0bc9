"""The benchmark harness: what every benchmark script in scripts/ shares.

    corpus.py         a seeded dataset of real English text, prompts of N tokens
    client.py         the one streaming client (SSE) for any OpenAI-compatible server, its load
                      runner and its metrics (TTFT, TPOT, ITL, throughput)
    engines.py        the in-process engine and the whole stack, built from scripts/serve's flags
    stats.py          percentiles, summaries, ratios
    record.py         one result record per run: results, settings, command, commit, machine;
                      ``--record`` keeps it under docs/benchmarks/results/
    peers.py          the engines we compare with (vLLM's CPU backend, llama.cpp) and the ratios
    summary.py        docs/BENCHMARKS.md and its plots, from the newest records
    otlp_receiver.py  a local OTLP trace receiver (the tracing benchmark and tests)

A benchmark is a thin main: its flags, its workload, one ``record.Record``. Scripts run
from scripts/ (``.venv/bin/python scripts/bench_x.py``), which puts this package on the path;
the checkout the script belongs to goes first on the path here, once, so a benchmark measures
the code beside it (and reaches the tests' Hugging Face reference, tests/hf_reference.py).
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
