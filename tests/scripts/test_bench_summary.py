"""docs/BENCHMARKS.md and its plots are made from the result records (scripts/bench_summary.py)."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
from bench import diary, record, summary
from bench.record import Record


def test_the_page_is_made_from_the_records_and_opens_with_the_summary():
    latest = record.latest()
    page = summary.PAGE.read_text()
    assert page == summary.render(latest, diary.index(diary.DIARY.read_text())), "run scripts/bench_summary.py"
    assert diary.GENERATED_MARK in page
    assert page.startswith("# Benchmarks\n") and "BENCHMARKS-diary.md" in page
    # Every plot the page shows exists, and every question has its record.
    for image in re.findall(r"!\[[^]]*\]\((benchmarks/[^)]+\.png)\)", page):
        assert (summary.DOCS / image).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", image
    assert {q.id for q in summary.QUESTIONS} - {"tracing-cost"} <= set(latest)
    for rec in latest.values():
        assert rec.results.get("table") or rec.results.get("series"), rec.question
        assert rec.command and rec.machine.get("cpu"), rec.question


def test_a_peers_record_gives_the_servers_side_by_side_and_two_plots(tmp_path):
    series = {"ours": {"1": {"output_tok_s": 80.0, "ttft_ms": 100.0, "tpot_ms": 11.0},
                       "32": {"output_tok_s": 500.0, "ttft_ms": 1000.0, "tpot_ms": 40.0}},
              "llama-server": {"1": {"output_tok_s": 70.0, "ttft_ms": 400.0, "tpot_ms": 9.0},
                               "32": {"output_tok_s": 125.0, "ttft_ms": 5000.0, "tpot_ms": 160.0}}}
    rec = Record("peers", "serving-vs-peers", results={"series": series, "targets": ["met: x"]}, command="cmd",
                 commit="abc1234", machine={"cpu": "a CPU"})
    (tmp_path / "results" / "serving-vs-peers").mkdir(parents=True)
    (tmp_path / "results" / "serving-vs-peers" / rec.file_name()).write_text(rec.to_json())
    written = summary.write(tmp_path / "results", tmp_path / "BENCHMARKS.md", tmp_path / "plots")
    assert sorted(p.name for p in written[1:]) == ["serving-vs-peers-throughput.png", "serving-vs-peers-ttft.png"]
    page = (tmp_path / "BENCHMARKS.md").read_text()
    assert "| concurrency | natsllm tok/s | llama.cpp llama-server tok/s |" in page
    assert "| 32 | 500.0 | 125.0 | 1000 | 5000 | 4.00 |" in page
    assert "- met: x" in page and "commit abc1234" in page and "No record yet." in page


def test_a_record_keeps_the_commit_the_machine_and_the_command(tmp_path):
    rec = Record("tracing", "tracing-cost", results={"table": [{"a": 1.0}]})
    assert re.fullmatch(r"[0-9a-f]{7,}(\+changes)?|unknown", rec.commit)
    assert "logical CPUs" in rec.machine["cpu"] and rec.command
    args = type("Args", (), {"result_file": str(tmp_path / "r.json"), "record": False})()
    [path] = record.save(rec, args)
    assert record.load(path) == Record(**json.loads(rec.to_json()))


def test_a_peers_run_folder_becomes_one_comparison_record(tmp_path, capsys):
    import bench_compare_peers

    def run(label: str, conc: int, tok_s: float, ttft: float) -> None:
        metrics = {"output_throughput": tok_s, "ttft_ms": {"median": ttft}, "tpot_ms": {"median": 10.0}, "failed": 0}
        rec = Record("serving", "serving", results={"label": label, "metrics": metrics},
                     config={"max_concurrency": conc, "input_len": 128, "output_len": 64, "endpoint": "completions"})
        (tmp_path / f"{label}-c{conc}.json").write_text(rec.to_json())

    for conc, ours, vllm_bf16, vllm_fp32 in ((1, 80.0, 40.0, 30.0), (32, 500.0, 320.0, 190.0)):
        run("ours", conc, ours, 100.0 * conc)
        run("vllm-cpu-bfloat16", conc, vllm_bf16, 110.0 * conc)
        run("vllm-cpu-float32", conc, vllm_fp32, 200.0 * conc)
    out = tmp_path / "summary.json"
    assert bench_compare_peers.main([str(tmp_path), "--result-file", str(out)]) == 0
    assert "met: vllm-cpu c32 output_tok_s_ratio 1.56" in capsys.readouterr().out
    rec = record.load(out)
    assert rec.question == "serving-vs-peers" and rec.config["input_len"] == 128
    assert rec.results["series"]["vllm-cpu"]["32"]["output_tok_s"] == 320.0  # the better dtype
    assert {row["peer"] for row in rec.results["table"]} == {"vllm-cpu", "vllm-cpu-bfloat16", "vllm-cpu-float32"}


def test_a_section_written_into_the_page_by_hand_moves_to_the_diary(tmp_path):
    results, page, diary_file = tmp_path / "results", tmp_path / "BENCHMARKS.md", tmp_path / "BENCHMARKS-diary.md"
    results.mkdir()
    diary_file.write_text("# Benchmarks: the diary\n\n## Old figures\n\nThey were slow.\n")
    summary.write(results, page, tmp_path / "plots", diary_file)
    made = page.read_text()
    assert "- [Old figures](BENCHMARKS-diary.md#old-figures)" in made
    hand = "## New kernel (issue 99)\n\n| x | y |\n|---|---|\n| 1 | 2 |\n"
    page.write_text(made + "\n" + hand)
    summary.write(results, page, tmp_path / "plots", diary_file)
    assert diary_file.read_text().endswith("They were slow.\n\n" + hand)
    assert page.read_text() == summary.render({}, diary.index(diary_file.read_text()))
    assert "(BENCHMARKS-diary.md#new-kernel-issue-99)" in page.read_text()
    summary.write(results, page, tmp_path / "plots", diary_file)  # nothing moves twice
    assert diary_file.read_text().count("## New kernel") == 1


def test_a_merge_with_a_branch_that_still_had_the_diary_as_the_page_keeps_its_section(tmp_path):
    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=False,
                       capture_output=True)

    old = "# Benchmarks\n\n## Old figures\n\nThey were slow.\n"
    docs = tmp_path / "docs"
    docs.mkdir()
    git("init", "-q", "-b", "main")
    (docs / "BENCHMARKS.md").write_text(old)
    git("add", "-A"), git("commit", "-qm", "base")
    git("checkout", "-qb", "summary")
    # The summary's side moved the diary and appended a section of its own at the same place.
    (docs / "BENCHMARKS-diary.md").write_text(old.replace("# Benchmarks", "# Benchmarks: the diary")
                                              + "\n## Tracing (issue 35)\n\nCheap.\n")
    (docs / "BENCHMARKS.md").write_text(f"# Benchmarks\n\n{diary.GENERATED_MARK} -->\n\n## Contents\n")
    git("add", "-A"), git("commit", "-qm", "summary")
    git("checkout", "-q", "main")
    (docs / "BENCHMARKS.md").write_text(old + "\n## New figures (issue 99)\n\nFaster.\n")
    git("commit", "-qam", "new section")
    git("merge", "-q", "summary")  # main takes the summary: BENCHMARKS.md conflicts
    assert "<<<<<<<" in (docs / "BENCHMARKS.md").read_text()
    said = diary.merge_conflict(docs / "BENCHMARKS-diary.md", tmp_path)
    assert "ours" in said  # main's side was the diary's form
    assert (docs / "BENCHMARKS-diary.md").read_text() == (
        "# Benchmarks: the diary\n\n## Old figures\n\nThey were slow.\n\n## Tracing (issue 35)\n\nCheap.\n"
        "\n## New figures (issue 99)\n\nFaster.\n")
    with pytest.raises(diary.DiaryError, match="conflict markers"):
        diary.rescue((docs / "BENCHMARKS.md").read_text(), set(), docs / "BENCHMARKS-diary.md")
