"""Revisits that do not fit: documents about 4x the device pool, asked about in turn, round
after round, with the KV tiers off and on.

The device pool is set small (``--num-gpu-blocks``); each request is one document and that
round's question (a completion of a few tokens, streamed). From round 2 on, a document's
blocks are long gone from the device: with the tiers on they come back from the host tier.
Printed per configuration: each request's TTFT and cached prompt tokens; the share of the
reusable prompt tokens (the document's whole blocks) that came from a tier from round 2 on
(``prompt_tokens_by_source{source="external_kv_transfer"}`` over those requests), and the
median TTFT from round 2 on, tiers on over tiers off.

    .venv/bin/python scripts/bench_kv_revisit.py [--pool-blocks 64] [--documents 4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kv_tiers_bench import complete, documents, header, metric, metrics, question, serving, summary  # noqa: E402

BLOCK = 16


def run(args: list[str], docs: list[list[int]], rounds: int, max_tokens: int) -> dict:
    """Every document in turn, ``rounds`` times: TTFTs and cached tokens by round, and the
    prompt tokens a tier supplied from round 2 on."""
    by_round = []
    with serving(args) as stack:
        before_round_2 = None
        for r in range(rounds):
            if r == 1:
                before_round_2 = metrics(stack.base_url)
            timed = [complete(stack.base_url, doc + question(r), max_tokens) for doc in docs]
            by_round.append(timed)
            print(f"  round {r + 1}: TTFT ms " + " ".join(f"{t.ttft * 1e3:.0f}" for t in timed)
                  + " | cached " + " ".join(str(t.cached_tokens) for t in timed), flush=True)
        after = metrics(stack.base_url)
    source = "natsllm:prompt_tokens_by_source_total"
    from_tier = (metric(after, source, source="external_kv_transfer")
                 - metric(before_round_2, source, source="external_kv_transfer")) if rounds > 1 else 0
    return {"by_round": by_round, "from_tier": from_tier}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pool-blocks", type=int, default=64)
    parser.add_argument("--documents", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--host-gib", type=float, default=1.0)
    args = parser.parse_args()
    header("KV tiers: revisits of documents that do not fit the device pool")
    # Each document takes about the whole pool (its question and a few tokens must fit too).
    doc_tokens = (args.pool_blocks - 3) * BLOCK
    docs = documents(args.documents, doc_tokens)
    pool = ["--num-gpu-blocks", str(args.pool_blocks)]
    results = {}
    for name, extra in (("off", []), ("on", ["--kv-offloading-size", str(args.host_gib)])):
        print(f"tiers {name}: {' '.join(pool + extra)}", flush=True)
        results[name] = run(pool + extra, docs, args.rounds, args.max_tokens)
    later = slice(1, None)
    ttft = {name: statistics.median(t.ttft for rnd in res["by_round"][later] for t in rnd)
            for name, res in results.items()}
    reusable = sum(len(doc) // BLOCK * BLOCK for doc in docs) * (args.rounds - 1)
    share = results["on"]["from_tier"] / reusable
    print(f"from round 2: {share:.1%} of the reusable prompt tokens from a tier; median TTFT on "
          f"{ttft['on'] * 1e3:.0f} ms / off {ttft['off'] * 1e3:.0f} ms = {ttft['on'] / ttft['off']:.3f}x", flush=True)
    summary({"pool_blocks": args.pool_blocks, "documents": args.documents, "document_tokens": doc_tokens,
             "rounds": args.rounds, "tier_share_from_round_2": share,
             "median_ttft_ms_from_round_2": {k: v * 1e3 for k, v in ttft.items()},
             "ttft_ratio_on_over_off": ttft["on"] / ttft["off"]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
