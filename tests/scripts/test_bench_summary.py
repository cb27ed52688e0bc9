"""docs/BENCHMARKS.md and its plots are made from the result records (scripts/bench_summary.py)."""

from __future__ import annotations

import json
import re

from bench import record, summary
from bench.record import Record


def test_the_page_is_made_from_the_records_and_opens_with_the_summary():
    latest = record.latest()
    page = summary.PAGE.read_text()
    assert page == summary.render(latest), "run scripts/bench_summary.py"
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
