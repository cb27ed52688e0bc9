"""Makes docs/BENCHMARKS.md and its plots from the newest result record of each question.

    .venv/bin/python scripts/bench_summary.py [--merge-diary]

A section written into BENCHMARKS.md by hand moves to docs/BENCHMARKS-diary.md first.
``--merge-diary``, in a git merge where BENCHMARKS.md conflicts because the other side
still had it as the diary (a branch older than the summary that added a section): that
side's changes go into docs/BENCHMARKS-diary.md (``git merge-file``), then the page is
made; ``git add docs/BENCHMARKS.md docs/BENCHMARKS-diary.md docs/benchmarks`` after.
(``scripts/bench/summary.py`` and ``scripts/bench/diary.py`` say more.)
"""

from __future__ import annotations

import argparse
import sys

from bench.diary import DiaryError, merge_conflict
from bench.summary import write


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--merge-diary", action="store_true",
                        help="in a merge conflict on BENCHMARKS.md: the diary side's changes into the diary first")
    args = parser.parse_args(argv)
    try:
        if args.merge_diary:
            print(merge_conflict())
        for path in write(rescue=not args.merge_diary):
            print(f"wrote {path}")
    except DiaryError as e:
        print(f"bench_summary: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
