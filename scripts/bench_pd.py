"""P/D disaggregation vs one colocated engine: what long prompts cost the decoding streams.

Starts a stack on this machine (``services.launch.stack``), first with one colocated engine,
then with one prefill and one decode engine (``--prefill-engines 1 --decode-engines 1``),
and runs the same load on each: ``--streams`` streams decoding ``--output-len`` tokens
each, and, once they all decode, ``--long-prompts`` prompts of ``--long-len`` tokens
arriving every ``--long-interval`` seconds (each asking for a few tokens). It reports the
decoding streams' inter-token latency (p50 / p99 / max, over every gap between two of
their tokens) and, for P/D, the KV transfer rate: bytes the decode engine pulled over the
seconds from hand-off to loaded, summed over requests (queueing included), from its
``EngineStats``. Prompts are real text (the harness's corpus, ``bench.corpus``), seeded.

    .venv/bin/python scripts/bench_pd.py --streams 16 --output-len 96 --long-prompts 4 --long-len 2048

Every engine process runs on this machine: on a small CPU the prefill and decode workers
compete for the same cores, which the figures show as they are.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time

import httpx
import nats

from bench import record
from bench.client import send_request
from bench.corpus import default_encoder, load_sentences, text_of_tokens
from bench.engines import stack
from bench.stats import summarize
from shared.protocol import ENGINE_STATS, ENGINE_STATS_MSG

MODEL = "SmolLM2-135M-Instruct"


async def run_load(base_url: str, streams: list[list[int]], long_prompts: list[list[int]], args) -> dict:
    url = base_url + "/v1/completions"

    def body(prompt: list[int], max_tokens: int) -> dict:
        return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                "stream": True}

    async with httpx.AsyncClient(timeout=args.timeout, trust_env=False) as http:
        started = [asyncio.Event() for _ in streams]
        decoding = [asyncio.ensure_future(send_request(http, url, "completions", body(p, args.output_len), len(p),
                                                       args.timeout, first_text=e))
                    for p, e in zip(streams, started)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), args.timeout)
        long_tasks = []
        for prompt in long_prompts:
            long_tasks.append(asyncio.ensure_future(send_request(http, url, "completions", body(prompt, 4),
                                                                 len(prompt), args.timeout)))
            await asyncio.sleep(args.long_interval)
        decoded = await asyncio.gather(*decoding)
        longs = await asyncio.gather(*long_tasks)
    failed = [r.error for r in (*decoded, *longs) if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} request(s) failed: {failed[:3]}")
    gaps = [gap for r in decoded for gap in r.itl]
    return {"itl": summarize(gaps, (50, 99)), "tokens": sum(r.output_tokens for r in decoded),
            "long_prompt_tokens": sum(r.output_tokens for r in longs)}


async def decode_engine_stats(nats_url: str, credentials: dict, engine_id: str) -> dict:
    nc = await nats.connect(nats_url, **credentials)
    try:
        sub = await nc.subscribe(ENGINE_STATS)
        while True:
            stats = ENGINE_STATS_MSG.decode((await sub.next_msg(timeout=5)).data)
            if stats.engine_id == engine_id:
                return {"bytes": stats.kv_transfer_bytes, "seconds": stats.kv_transfer_seconds,
                        "requests": stats.kv_transfer_requests, "fallbacks": stats.kv_transfer_fallbacks}
    finally:
        await nc.close()


def run_stack(label: str, pd: bool, streams, long_prompts, args) -> dict:
    flags = ["--cpu-kv-cache-gib", str(args.kv_gib), "--max-num-seqs", "32"]
    with stack(flags, timeout=600, prefill_engines=int(pd), decode_engines=int(pd), log_dir=args.log_dir) as running:
        asyncio.run(run_load(running.base_url, streams[:2], [], args))  # warm-up
        result = asyncio.run(run_load(running.base_url, streams, long_prompts, args))
        if pd:
            time.sleep(1.5)  # the stats after the load
            kv = asyncio.run(decode_engine_stats(running.nats.url, running.nats.credentials("admin"), "decode-0"))
            result["kv_transfer"] = kv
            result["kv_gb_per_s"] = kv["bytes"] / kv["seconds"] / 1e9 if kv["seconds"] else float("nan")
    print(f"{label}: ITL p50 {result['itl']['p50'] * 1000:.1f} ms, p99 {result['itl']['p99'] * 1000:.1f} ms, "
          f"max {result['itl']['max'] * 1000:.1f} ms" + (f", KV {result['kv_gb_per_s']:.3f} GB/s" if pd else ""),
          flush=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--stream-len", type=int, default=64, help="prompt tokens of each decoding stream")
    parser.add_argument("--output-len", type=int, default=96)
    parser.add_argument("--long-prompts", type=int, default=4)
    parser.add_argument("--long-len", type=int, default=2048)
    parser.add_argument("--long-interval", type=float, default=1.5)
    parser.add_argument("--kv-gib", type=float, default=0.5, help="KV cache per engine (GiB)")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", default=None)
    record.add_arguments(parser)
    args = parser.parse_args()
    encode, decode, _ = default_encoder()
    rng = random.Random(args.seed)
    sentences = load_sentences()

    def prompt(n):
        return text_of_tokens(rng, sentences, n, encode, decode)[1]

    streams = [prompt(args.stream_len) for _ in range(args.streams)]
    long_prompts = [prompt(args.long_len) for _ in range(args.long_prompts)]
    results = {"colocated": run_stack("colocated", False, streams, long_prompts, args),
               "pd": run_stack("P/D 1+1", True, streams, long_prompts, args)}
    p99 = results["pd"]["itl"]["p99"] / results["colocated"]["itl"]["p99"]
    print(f"p99 ITL P/D / colocated: {p99:.2f}")
    results["p99_itl_ratio_pd_over_colocated"] = p99
    table = [{"engines": name, "ITL p50 ms": r["itl"]["p50"] * 1000, "ITL p99 ms": r["itl"]["p99"] * 1000,
              "ITL max ms": r["itl"]["max"] * 1000, "KV GB/s (hand-off to loaded)": r.get("kv_gb_per_s")}
             for name, r in (("colocated, 1 engine", results["colocated"]), ("P/D, 1 prefill + 1 decode", results["pd"]))]
    table.append({"engines": "P/D / colocated", **{k: table[1][k] / table[0][k] for k in
                                                   ("ITL p50 ms", "ITL p99 ms", "ITL max ms")}})
    config = {k: v for k, v in vars(args).items() if k not in ("record", "result_file", "log_dir")}
    record.save(record.Record("pd", "pd", config=config, results={"table": table, **results}), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
