"""docs/BENCHMARKS-diary.md: the history of the figures, with their reasoning.

docs/BENCHMARKS.md is made from the result records (``summary.py``); prose belongs in the
diary. Text meant for the diary that reaches the page instead is moved, never lost:

- a section written into BENCHMARKS.md by hand: before ``scripts/bench_summary.py``
  rewrites the page, every ``## `` section the page would not make itself goes to the end
  of the diary (``rescue``);
- a section another branch added to BENCHMARKS.md while it still was the diary: merging
  that branch with one where it is the summary, git reports a conflict in BENCHMARKS.md;
  ``scripts/bench_summary.py --merge-diary`` applies that side's changes to the diary
  (``git merge-file --union``: from the merge base to that side, onto the diary; where both
  added text at one place, both stay), then rewrites the page (``merge_conflict``).

The page carries ``GENERATED_MARK``: that is how a version of BENCHMARKS.md is told from
one in the diary's form.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

from . import ROOT

DIARY = ROOT / "docs" / "BENCHMARKS-diary.md"
PAGE_PATH = "docs/BENCHMARKS.md"  # in the repository, for git
GENERATED_MARK = "<!-- Made by scripts/bench_summary.py"
CONFLICT_MARK = "<<<<<<< "


class DiaryError(Exception):
    pass


def sections(text: str) -> list[tuple[str, str]]:
    """(heading, text) of each ``## `` section in order; text before the first: heading ""."""
    out: list[tuple[str, list[str]]] = [("", [])]
    for line in text.splitlines(keepends=True):
        if line.startswith("## "):
            out.append((line[3:].strip(), []))
        out[-1][1].append(line)
    return [(heading, "".join(lines)) for heading, lines in out if heading or "".join(lines).strip()]


def anchor(title: str) -> str:
    """GitHub's anchor for a heading (without the -1, -2 of repeated headings)."""
    kept = "".join(ch for ch in title.lower() if ch.isalnum() or ch in " -_")
    return kept.replace(" ", "-")


def index(text: str) -> list[tuple[str, str]]:
    """(heading, anchor) of the diary's sections, repeated headings numbered as GitHub does."""
    seen: dict[str, int] = {}
    out = []
    for heading, _ in sections(text):
        if not heading:
            continue
        base = anchor(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.append((heading, base if count == 0 else f"{base}-{count}"))
    return out


def rescue(page_text: str, generated: set[str], diary: Path = DIARY) -> list[str]:
    """Append to ``diary`` each section of ``page_text`` whose heading the page does not
    make (``generated``), unless the diary has it word for word; the headings moved."""
    if CONFLICT_MARK in page_text:
        raise DiaryError(f"{PAGE_PATH} has conflict markers: run scripts/bench_summary.py --merge-diary")
    diary_text = diary.read_text()
    moved = []
    for heading, text in sections(page_text):
        if not heading or heading in generated or text.strip() in diary_text:
            continue
        diary_text = diary_text.rstrip("\n") + "\n\n" + text.strip("\n") + "\n"
        moved.append(heading)
    if moved:
        diary.write_text(diary_text)
    return moved


def _stage(number: int, path: str, repo: Path) -> str | None:
    done = subprocess.run(["git", "show", f":{number}:{path}"], cwd=repo, capture_output=True, text=True)
    return done.stdout if done.returncode == 0 else None


def merge_conflict(diary: Path = DIARY, repo: Path = ROOT) -> str:
    """In a merge with a conflict in BENCHMARKS.md between the summary (one side) and the
    diary's form (the other side, and the merge base): the diary side's changes since the
    base, applied to ``diary``. Returns what was done; DiaryError when git's stages are
    not that, or when the diary is left with conflicts to resolve by hand."""
    base, ours, theirs = (_stage(n, PAGE_PATH, repo) for n in (1, 2, 3))
    if ours is None or theirs is None:
        raise DiaryError(f"no conflict in {PAGE_PATH} (git has no 'ours' and 'theirs' stages)")
    diary_side = [(name, text) for name, text in (("ours", ours), ("theirs", theirs)) if GENERATED_MARK not in text]
    if len(diary_side) != 1:
        raise DiaryError(f"expected one side of {PAGE_PATH} to be the summary and the other the diary's form, "
                         f"found {2 - len(diary_side)} summaries")
    name, side = diary_side[0]
    if base is None or GENERATED_MARK in base:
        base = ""  # the diary's form arrived whole on that side: all of it is new
    with tempfile.TemporaryDirectory() as tmp:
        base_file, side_file = Path(tmp) / "base.md", Path(tmp) / "side.md"
        base_file.write_text(base)
        side_file.write_text(side)
        # --union: where both added text at the same place (each a section at the end), both
        # stay, the diary's first; a diary loses nothing that way.
        done = subprocess.run(["git", "merge-file", "--union", "-L", "diary", "-L", "merge base", "-L", name,
                               str(diary), str(base_file), str(side_file)], capture_output=True, text=True)
    if done.returncode < 0 or done.returncode > 127:
        raise DiaryError(f"git merge-file failed: {done.stderr.strip()}")
    if done.returncode:
        raise DiaryError(f"{done.returncode} conflict(s) left in {diary}: resolve them there, then run "
                         "scripts/bench_summary.py")
    # The union keeps one of the blank lines both sides put before their new sections.
    diary.write_text(re.sub(r"(?m)^(?!\n)(.+)\n(## )", r"\1\n\n\2", diary.read_text()))
    return f"{PAGE_PATH}: the changes of {name} since the merge base are in {diary.name}"
