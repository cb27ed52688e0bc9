"""scripts/bench_tracing.py's arithmetic: on/off ratios per ABBA pair of rounds, their 95%
interval, and the verdict against the 3% bar (met only when the whole interval clears it)."""

from __future__ import annotations

from argparse import Namespace

import bench_tracing


def runs(pairs: list[tuple[float, float]]) -> list[dict]:
    """ABBA rounds from (off, on) throughputs; each round 64 tokens per CPU-second less."""
    out = []
    for i, (off, on) in enumerate(pairs):
        rounds = [(False, off), (True, on)] if i % 2 == 0 else [(True, on), (False, off)]
        out += [{"traced": traced, "output_tok_s": tok_s, "output_tok_per_cpu_s": tok_s - 64, "spans": 14 * traced,
                 "completed": 1, "cpu_s_by_process": {"gateway": 1.0}, "client_and_receiver_cpu_s": 0.5}
                for traced, tok_s in rounds]
    return out


def test_the_pairs_ratios_make_the_verdict():
    args = Namespace(mode="requests", output_len=64)
    close = runs([(1000, 995), (1000, 990), (1000, 1000), (1000, 985)])
    assert bench_tracing.pair_ratios(close, "output_tok_s") == [0.995, 0.99, 1.0, 0.985]
    row, target = bench_tracing.summary(close, args)
    assert target.startswith("met") and row["tok/s on/off (mean of pairs, 95% CI)"].startswith("0.99")
    assert row["spans per traced request"] == 14
    assert bench_tracing.summary(runs([(1000, 950), (1000, 940), (1000, 955)]), args)[1].startswith("MISSED")
    assert bench_tracing.summary(runs([(1000, 900), (1000, 1040)]), args)[1].startswith("not shown")
    assert bench_tracing.cpu_ms_per_token(close, True, args)["gateway"] == 1000 / 64
