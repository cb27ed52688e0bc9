"""The names ``scripts/bench_common.py`` had before the harness (``scripts/bench/``), for
benchmark scripts written against it: each is the harness's own. New benchmarks import
``bench.corpus``, ``bench.stats``, ``bench.record``, ``bench.peers`` and ``bench.client``
themselves."""

from bench.client import check_loopback_url
from bench.corpus import (
    PARAGRAPHS,
    SampleRequest,
    draw_lengths,
    load_sentences,
    make_dataset,
    split_sentences,
    text_of_tokens,
)
from bench.peers import (
    PEER_TARGETS,
    best_of_configurations,
    check_targets,
    compare_peers,
    format_peer_table,
    from_vllm_bench,
    load_serving_results,
)
from bench.record import CPU_FLAGS_OF_NOTE, describe_cpu
from bench.stats import fmt, percentile, ratio, summarize

__all__ = [
    "CPU_FLAGS_OF_NOTE", "PARAGRAPHS", "PEER_TARGETS", "SampleRequest", "best_of_configurations", "check_loopback_url",
    "check_targets", "compare_peers", "describe_cpu", "draw_lengths", "fmt", "format_peer_table", "from_vllm_bench",
    "load_sentences", "load_serving_results", "make_dataset", "percentile", "ratio", "split_sentences", "summarize",
    "text_of_tokens",
]
