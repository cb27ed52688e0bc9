"""Makes docs/BENCHMARKS.md and its plots from the newest result record of each question.

    .venv/bin/python scripts/bench_summary.py

(``scripts/bench/summary.py`` says what it writes.)
"""

from __future__ import annotations

import sys

from bench.summary import write


def main() -> int:
    for path in write():
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
