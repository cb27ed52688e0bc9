"""P/D disaggregation vs one colocated engine: what long prompts cost the decoding streams.

Starts a stack on this machine (``services.launch.stack``), first with one colocated engine,
then with one prefill and one decode engine (``--prefill-engines 1 --decode-engines 1``),
and runs the same load on each: ``--streams`` streams decoding ``--output-len`` tokens
each, and, once they all decode, ``--long-prompts`` prompts of ``--long-len`` tokens
arriving every ``--long-interval`` seconds (each asking for a few tokens). It reports the
decoding streams' inter-token latency (p50 / p99 / max, over every gap between two of
their tokens) and, for P/D, the KV transfer rate: bytes the decode engine pulled over the
seconds from hand-off to loaded, summed over requests (queueing included), from its
``EngineStats``. Prompts are real text (``bench_common.text_of_tokens``), seeded.

    .venv/bin/python scripts/bench_pd.py --streams 16 --output-len 96 --long-prompts 4 --long-len 2048

Every engine process runs on this machine: on a small CPU the prefill and decode workers
compete for the same cores, which the figures show as they are.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import nats  # noqa: E402

from bench_common import load_sentences, summarize, text_of_tokens  # noqa: E402
from services.launch.nats_server import free_port  # noqa: E402
from services.launch.stack import Stack, StackConfig  # noqa: E402
from shared.model_config import default_model_path  # noqa: E402
from shared.protocol import ENGINE_STATS, ENGINE_STATS_MSG  # noqa: E402
from shared.tokenizer import load_tokenizer  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"


async def stream_token_times(http: httpx.AsyncClient, prompt: list[int], max_tokens: int,
                             first_token: asyncio.Event | None = None) -> list[float]:
    """Arrival times of each streamed chunk with text (one per token on our engine)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    times = []
    async with http.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                times.append(time.monotonic())
                if first_token is not None:
                    first_token.set()
    return times


async def run_load(base_url: str, streams: list[list[int]], long_prompts: list[list[int]], args) -> dict:
    async with httpx.AsyncClient(base_url=base_url, timeout=args.timeout) as http:
        started = [asyncio.Event() for _ in streams]
        decoding = [asyncio.ensure_future(stream_token_times(http, p, args.output_len, e))
                    for p, e in zip(streams, started)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), args.timeout)
        long_tasks = []
        for prompt in long_prompts:
            long_tasks.append(asyncio.ensure_future(stream_token_times(http, prompt, 4)))
            await asyncio.sleep(args.long_interval)
        stream_times = await asyncio.gather(*decoding)
        long_times = await asyncio.gather(*long_tasks)
    gaps = [b - a for times in stream_times for a, b in zip(times, times[1:])]
    return {"itl": summarize(gaps, (50, 99)), "tokens": sum(map(len, stream_times)),
            "long_prompt_tokens": sum(map(len, long_times))}


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
    config = StackConfig(port=free_port(), prefill_engines=int(pd), decode_engines=int(pd),
                         args=["--cpu-kv-cache-gib", str(args.kv_gib), "--max-num-seqs", "32"],
                         log_dir=args.log_dir)
    stack = Stack(config)
    stack.start()
    try:
        stack.wait_ready(timeout=600)
        asyncio.run(run_load(stack.base_url, streams[:2], [], args))  # warm-up
        result = asyncio.run(run_load(stack.base_url, streams, long_prompts, args))
        if pd:
            time.sleep(1.5)  # the stats after the load
            kv = asyncio.run(decode_engine_stats(stack.nats.url, stack.nats.credentials("admin"), "decode-0"))
            result["kv_transfer"] = kv
            result["kv_gb_per_s"] = kv["bytes"] / kv["seconds"] / 1e9 if kv["seconds"] else float("nan")
    finally:
        stack.stop()
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
    parser.add_argument("--result-file", default=None)
    args = parser.parse_args()
    tokenizer = load_tokenizer(default_model_path())
    rng = random.Random(args.seed)
    sentences = load_sentences()

    def prompt(n):
        return text_of_tokens(rng, sentences, n, lambda t: tokenizer.encode(t, add_special_tokens=False),
                              tokenizer.decode)[1]

    streams = [prompt(args.stream_len) for _ in range(args.streams)]
    long_prompts = [prompt(args.long_len) for _ in range(args.long_prompts)]
    results = {"colocated": run_stack("colocated", False, streams, long_prompts, args),
               "pd": run_stack("P/D 1+1", True, streams, long_prompts, args)}
    p99 = results["pd"]["itl"]["p99"] / results["colocated"]["itl"]["p99"]
    print(f"p99 ITL P/D / colocated: {p99:.2f}")
    results["p99_itl_ratio_pd_over_colocated"] = p99
    if args.result_file:
        Path(args.result_file).write_text(json.dumps({"args": vars(args), **results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
