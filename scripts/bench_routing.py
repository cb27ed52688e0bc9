"""Routing policies on data-parallel engines: prefix-cache hit rate, TTFT, throughput, balance.

Starts a ``--data-parallel-size 2`` stack on this machine (two tokenizer replicas, so two
routers) for each policy of ``--policies`` (``--router-mode``), and runs the same open-loop
loads on each (Poisson arrivals at ``--rate`` requests per second, every request streamed):

    shared-prefix  ``--groups`` system prompts of ``--prefix-len`` tokens; a request is one
                   group's prompt (chosen at random) and a question of ``--suffix-len`` tokens.
                   The prefixes together exceed one engine's KV cache (``--num-gpu-blocks``)
                   but fit in both.
    no-reuse       prompts of ``--prefix-len + --suffix-len`` tokens that share nothing.

Each run reports the prefix-cache hit rate (cached prompt tokens over prompt tokens, from each
response's ``usage.prompt_tokens_details.cached_tokens``), TTFT p50 / p90 (client side),
throughput (output tokens per second of the run) and each engine's share of the requests
(from its stats' admissions). Two more runs of the shared-prefix load: ``reference``, one engine
holding both engines' blocks (``--num-gpu-blocks`` doubled), and ``kv-faults`` (``--fault``):
kv with 1% of the KV event batches dropped (``NATSLLM_TEST_KV_EVENT_FAULTS``) and one router
(tokenizer replica) killed when half the requests were sent (the launcher starts it again);
its hit rate is also given per window of ``--window`` requests, beside kv's. Beside the
ratios, the shared-prefix load's ceiling: its hit rate if every request but its group's
first hit its prefix's full blocks (no placement does better, but for the odd first block
two text prompts share), as ``hit_kv_over_ceiling`` and ``hit_ceiling_over_random`` (the
most kv / random can be on this load). Prompts are real text (``bench_common``), seeded;
each run has its own ``cache_salt``, so no run hits another's blocks. ``--temperature`` and
``--top-p`` make the requests sampled. ``--client vllm`` sends the same loads with vLLM's own
`bench serve` instead (``bench.vllm_client``; its datasets ``prefix_repetition`` and ``random``,
random tokens instead of text), the hit rate then from the engines' prefix-cache counters.

The result is one record (``bench.record``: every run's figures, a table of them and issue 31's
targets met or not); ``--record`` keeps it for docs/BENCHMARKS.md ("Routing", and "Routing,
measured with vLLM's client" for ``--client vllm``).

    .venv/bin/python scripts/bench_routing.py --policies kv,least-loaded,round-robin,random --fault --record
    .venv/bin/python scripts/bench_routing.py --merge a.json b.json   # the ratios over several runs' files
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import nats  # noqa: E402

from bench import record, vllm_client  # noqa: E402
from bench.client import prefix_cache_counts  # noqa: E402
from bench_common import describe_cpu, load_sentences, summarize, text_of_tokens  # noqa: E402
from services.launch.nats_server import free_port  # noqa: E402
from services.launch.stack import Stack, StackConfig  # noqa: E402
from shared.config import CacheConfig  # noqa: E402
from shared.kv_event_faults import ENV_VAR as FAULTS_ENV  # noqa: E402
from shared.model_config import default_model_path  # noqa: E402
from shared.protocol import ENGINE_STATS, ENGINE_STATS_MSG  # noqa: E402
from shared.tokenizer import load_tokenizer  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
BLOCK_SIZE = CacheConfig().block_size  # the engines' (the stacks here keep the default)
POLICIES = ("kv", "least-loaded", "round-robin", "random")


def shared_prefix_load(rng: random.Random, prompt, args) -> list[list[int]]:
    prefixes = [prompt(args.prefix_len) for _ in range(args.groups)]
    return [rng.choice(prefixes) + prompt(args.suffix_len) for _ in range(args.requests)]


def no_reuse_load(rng: random.Random, prompt, args) -> list[list[int]]:
    return [prompt(args.prefix_len + args.suffix_len) for _ in range(args.requests)]


def shared_prefix_ceiling(args, prompts: list[list[int]] | None) -> float:
    """The best hit rate any placement can give the shared-prefix load: every request but its
    group's first hits its prefix's full blocks, and nothing else is hit. ``prompts``: our
    load; None: vLLM's prefix_repetition (``--requests / --groups`` requests per prefix)."""
    hit = args.prefix_len // BLOCK_SIZE * BLOCK_SIZE
    if prompts is None:
        return (args.requests - args.groups) * hit / (args.requests * (args.prefix_len + args.suffix_len))
    seen: set[tuple[int, ...]] = set()
    hits = 0
    for p in prompts:
        prefix = tuple(p[:args.prefix_len])
        hits += hit if prefix in seen else 0
        seen.add(prefix)
    return hits / sum(map(len, prompts))


async def one_request(http: httpx.AsyncClient, prompt: list[int], salt: str, args) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": args.output_len, "temperature": args.temperature,
            "top_p": args.top_p, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "cache_salt": salt}
    start = time.monotonic()
    first = None
    usage = {}
    async with http.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("choices") and first is None:
                first = time.monotonic() - start
            if event.get("usage"):
                usage = event["usage"]
    return {"ttft": first, "prompt_tokens": usage.get("prompt_tokens", len(prompt)),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            "output_tokens": usage.get("completion_tokens", 0)}


async def run_load(base_url: str, prompts: list[list[int]], salt: str, args, at_half=None) -> dict:
    """Send ``prompts`` at Poisson times; ``at_half()`` runs (in a thread) once half are sent."""
    rng = random.Random(args.seed + 1)
    limits = httpx.Limits(max_connections=len(prompts) + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=args.timeout, limits=limits) as http:
        tasks, side = [], None
        start = time.monotonic()
        for i, prompt in enumerate(prompts):
            if i == len(prompts) // 2 and at_half is not None:
                side = asyncio.get_running_loop().run_in_executor(None, at_half)
            tasks.append(asyncio.ensure_future(one_request(http, prompt, salt, args)))
            await asyncio.sleep(rng.expovariate(args.rate))
        results = await asyncio.gather(*tasks)
        wall = time.monotonic() - start
        if side is not None:
            await side
    return {"results": results, "wall": wall}


def hit_rate(results: list[dict]) -> float:
    return sum(r["cached_tokens"] for r in results) / max(1, sum(r["prompt_tokens"] for r in results))


def summary(load: dict, admitted: dict[str, int], window: int) -> dict:
    results = load["results"]
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    ttft = summarize(ttfts, (50, 90))
    shares = sorted(admitted.values())
    return {
        "hit_rate": hit_rate(results),
        "ttft_p50": ttft["p50"], "ttft_p90": ttft["p90"],
        "throughput": sum(r["output_tokens"] for r in results) / load["wall"],
        "requests_per_engine": admitted,
        "busiest_over_least_busy": shares[-1] / shares[0] if shares and shares[0] else float("inf"),
        "hit_rate_windows": [hit_rate(results[i:i + window]) for i in range(0, len(results), window)],
        "cached_tokens": [r["cached_tokens"] for r in results],  # per request, in the load's order
    }


async def admissions(stack: Stack) -> dict[str, int]:
    """Each engine's count of admitted requests, from its next stats."""
    engine_ids = {e or "0" for e, _ in stack.config.engines()}
    nc = await nats.connect(stack.nats.url, **stack.nats.credentials("admin"))
    latest: dict[str, int] = {}
    try:
        sub = await nc.subscribe(ENGINE_STATS)
        deadline = time.monotonic() + 5
        while set(latest) < engine_ids and time.monotonic() < deadline:
            try:
                stats = ENGINE_STATS_MSG.decode((await sub.next_msg(timeout=1)).data)
            except Exception:
                continue
            latest[stats.engine_id] = stats.num_requests_admitted
    finally:
        await nc.close()
    return latest


# vLLM's `bench serve` datasets for the same loads (``--client vllm``): its prefix_repetition
# is ``--groups`` random-token prefixes, each with ``--requests / --groups`` random suffixes,
# shuffled: our shared-prefix load on tokens instead of text.
VLLM_DATASETS = {
    "shared-prefix": lambda args: [
        "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(args.prefix_len),
        "--prefix-repetition-suffix-len", str(args.suffix_len), "--prefix-repetition-num-prefixes", str(args.groups),
        "--prefix-repetition-output-len", str(args.output_len)],
    "no-reuse": lambda args: [
        "--dataset-name", "random", "--random-input-len", str(args.prefix_len + args.suffix_len),
        "--random-output-len", str(args.output_len), "--random-range-ratio", "0"],
}


def vllm_load(base_url: str, name: str, args, result_file: Path, at_half=None) -> dict:
    """The load ``name`` sent by vLLM's client at the same rate; ``at_half()`` runs (in a
    thread) when half the load's time has passed. Its result, and the engines' prefix-cache
    token counts (queries, hits) over it, from /metrics."""
    load_args = [*VLLM_DATASETS[name](args), "--num-prompts", str(args.requests), "--request-rate", str(args.rate),
                 "--ignore-eos", "--seed", str(args.seed), "--num-warmups", "0",
                 "--temperature", str(args.temperature), "--top-p", str(args.top_p)]
    before = prefix_cache_counts(base_url)
    timer = threading.Timer(args.requests / args.rate / 2, at_half) if at_half is not None else None
    if timer is not None:
        timer.start()
    try:
        result = vllm_client.bench_serve(base_url, MODEL, load_args, result_file, args.timeout)
    finally:
        if timer is not None:
            timer.join()
    time.sleep(1.5)  # the stats after the load
    after = prefix_cache_counts(base_url)
    return {"result": result, "queries": after["queries"] - before["queries"], "hits": after["hits"] - before["hits"]}


def vllm_summary(load: dict, admitted: dict[str, int]) -> dict:
    """``summary``'s figures from a run of vLLM's client (the hit rate from the engines'
    counters: no per-request ``cached_tokens``, so no windows)."""
    result = load["result"]
    shares = sorted(admitted.values())
    return {
        "hit_rate": load["hits"] / max(1.0, load["queries"]),
        "ttft_p50": result["median_ttft_ms"] / 1000, "ttft_p90": result["p90_ttft_ms"] / 1000,
        "throughput": result["output_throughput"],
        "requests_per_engine": admitted,
        "busiest_over_least_busy": shares[-1] / shares[0] if shares and shares[0] else float("inf"),
        "hit_rate_windows": [],
        "cached_tokens": [],
    }


def router_decisions(base_url: str) -> dict[str, float]:
    """The routers' decisions so far by reason (the gateway's /metrics, summed over routers)."""
    decisions: dict[str, float] = {}
    for line in httpx.get(base_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("natsllm:router_decisions_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            decisions[reason] = decisions.get(reason, 0.0) + float(line.rsplit(" ", 1)[1])
    return decisions


def run(label: str, loads: dict[str, list[list[int]]], args, mode: str = "kv", dp: int = 2, blocks: int = 0,
        fault: bool = False) -> dict:
    env = {FAULTS_ENV: "drop=0.01,seed=1"} if fault else {}
    config = StackConfig(port=free_port(), data_parallel_size=dp, num_tokenizers=2, env=env, log_dir=args.log_dir,
                         args=["--router-mode", mode, "--num-gpu-blocks", str(blocks or args.num_gpu_blocks),
                               "--max-num-seqs", "64", "--omp-wait-policy", args.omp_wait_policy])
    stack = Stack(config)
    stack.start()
    out = {}
    try:
        stack.wait_ready(timeout=600)
        warm = [[1000 + i] * 64 for i in range(4)]
        asyncio.run(run_load(stack.base_url, warm, f"warm-{label}", args))
        for name, prompts in loads.items():
            before, decided = asyncio.run(admissions(stack)), router_decisions(stack.base_url)
            # The router's restart: tokenizer-0 is killed (-9); the launcher starts it again.
            kill = (lambda: stack.supervisor.kill("tokenizer-0")) if fault else None
            if args.client == "vllm":
                load = vllm_load(stack.base_url, name, args, Path(args.vllm_results) / f"{label}-{name}.json", kill)
            else:
                load = asyncio.run(run_load(stack.base_url, prompts, f"{label}-{name}", args, kill))
                time.sleep(1.5)  # the stats after the load
            after = asyncio.run(admissions(stack))
            admitted = {e: after[e] - before.get(e, 0) for e in after}
            out[name] = vllm_summary(load, admitted) if args.client == "vllm" else summary(load, admitted, args.window)
            r = out[name]
            if name == "shared-prefix":
                r["ceiling"] = args.ceiling
            r["router_decisions"] = {k: v - decided.get(k, 0.0) for k, v in router_decisions(stack.base_url).items()
                                     if v - decided.get(k, 0.0) > 0}
            print(f"{label:14s} {name:14s} hit {r['hit_rate']:.3f}  TTFT p50 {r['ttft_p50'] * 1000:7.1f} ms  "
                  f"p90 {r['ttft_p90'] * 1000:7.1f} ms  {r['throughput']:6.1f} tok/s  "
                  f"requests {r['requests_per_engine']}  decisions {r['router_decisions']}", flush=True)
    finally:
        stack.stop()
    return out


def ratios(results: dict) -> dict:
    """The acceptance ratios of issue 31 from one run's results."""
    shared = {k: v["shared-prefix"] for k, v in results.items() if "shared-prefix" in v}
    got = {}
    if "kv" in shared and "random" in shared:
        got["hit_kv_over_random"] = shared["kv"]["hit_rate"] / max(shared["random"]["hit_rate"], 1e-9)
        got["ttft_p50_kv_over_random"] = shared["kv"]["ttft_p50"] / shared["random"]["ttft_p50"]
    if "kv" in shared and shared["kv"].get("ceiling"):
        got["hit_kv_over_ceiling"] = shared["kv"]["hit_rate"] / shared["kv"]["ceiling"]
    if "random" in shared and shared["random"].get("ceiling"):  # the most kv / random could be here
        got["hit_ceiling_over_random"] = shared["random"]["ceiling"] / max(shared["random"]["hit_rate"], 1e-9)
    if "kv" in shared and "reference" in shared:
        got["hit_kv_over_one_big_engine"] = shared["kv"]["hit_rate"] / shared["reference"]["hit_rate"]
    if "kv" in shared and "kv-faults" in shared:
        got["hit_points_lost_with_faults"] = 100 * (shared["kv"]["hit_rate"] - shared["kv-faults"]["hit_rate"])
    no_reuse = {k: v["no-reuse"] for k, v in results.items() if "no-reuse" in v}
    if "kv" in no_reuse:
        got["no_reuse_kv_busiest_over_least_busy"] = no_reuse["kv"]["busiest_over_least_busy"]
    if "kv" in no_reuse and "least-loaded" in no_reuse:
        got["no_reuse_ttft_p50_kv_over_least_loaded"] = no_reuse["kv"]["ttft_p50"] / no_reuse["least-loaded"][
            "ttft_p50"]
    return got


# Issue 31's targets: (ratio, how it compares, the bound, what it says).
TARGETS = (
    ("hit_kv_over_random", ">=", 2.0, "shared-prefix hit rate, kv / random"),
    ("hit_kv_over_one_big_engine", ">=", 0.9, "shared-prefix hit rate, kv / one engine holding both engines' blocks"),
    ("ttft_p50_kv_over_random", "<=", 0.5, "shared-prefix median TTFT, kv / random"),
    ("hit_points_lost_with_faults", "<=", 2.0,
     "hit-rate points lost with 1% of the events dropped and a router restarted"),
    ("no_reuse_kv_busiest_over_least_busy", "<=", 1.3, "no-reuse requests, busiest engine / least busy (kv)"),
    ("no_reuse_ttft_p50_kv_over_least_loaded", "<=", 1.1, "no-reuse median TTFT, kv / least-loaded"),
)


def targets(got: dict) -> list[str]:
    """Each target of issue 31 this run measured, its figure and whether it is met."""
    notes = []
    for key, how, bound, what in TARGETS:
        if key in got:
            met = got[key] >= bound if how == ">=" else got[key] <= bound
            notes.append(f"{what}: {got[key]:.2f} (target {'≥' if how == '>=' else '≤'} {bound:g}: "
                         f"{'met' if met else 'not met'})")
    if "hit_kv_over_ceiling" in got and "hit_ceiling_over_random" in got:
        notes.append(f"shared-prefix hit rate, kv / the load's ceiling (every request but its group's first hits "
                     f"its prefix): {got['hit_kv_over_ceiling']:.2f}; the ceiling / random: "
                     f"{got['hit_ceiling_over_random']:.2f}, the most kv / random can be on this load (not a target)")
    return notes


def table(results: dict) -> list[dict]:
    """One row per run and load: what docs/BENCHMARKS.md shows."""
    rows = []
    for label, loads in results.items():
        for name, r in loads.items():
            rows.append({"run": label, "load": name, "hit rate": r["hit_rate"], "TTFT p50 ms": 1000 * r["ttft_p50"],
                         "TTFT p90 ms": 1000 * r["ttft_p90"], "output tok/s": r["throughput"],
                         "busiest / least busy engine": r["busiest_over_least_busy"]})
    return rows


def report(results: dict, args) -> dict:
    """Print the acceptance ratios and, with a fault run, both runs' hit rate per window."""
    got = ratios(results)
    for key, value in got.items():
        print(f"{key}: {value:.3f}")
    for note in targets(got):
        print(note)
    shared = {k: v["shared-prefix"] for k, v in results.items() if "shared-prefix" in v}
    if "kv" in shared and "kv-faults" in shared and shared["kv"]["hit_rate_windows"]:  # none from vLLM's client
        print(f"hit rate per window of {args.window} requests, kv / kv-faults (a router killed after request "
              f"{args.requests // 2}):")
        print(" ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(shared["kv"]["hit_rate_windows"],
                                                          shared["kv-faults"]["hit_rate_windows"])))
    return got


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--workloads", default="shared-prefix,no-reuse")
    parser.add_argument("--requests", type=int, default=160)
    parser.add_argument("--rate", type=float, default=3.0, help="requests per second (Poisson)")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=256)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--client", choices=("ours", "vllm"), default="ours",
                        help="vllm: the loads sent by vLLM's `bench serve` (prefix_repetition, random; "
                             "from build/vllm-venv), the hit rate from the engines' counters")
    parser.add_argument("--num-gpu-blocks", type=int, default=80, help="KV cache blocks per engine")
    parser.add_argument("--reference", action=argparse.BooleanOptionalAction, default=True,
                        help="also one engine with both engines' blocks (shared-prefix)")
    parser.add_argument("--fault", action="store_true", help="also kv with dropped events and a router restart")
    parser.add_argument("--window", type=int, default=20, help="requests per hit-rate window")
    parser.add_argument("--omp-wait-policy", default="passive",
                        help="the workers' (they share the cores with the other services; see the setting)")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", default=None)
    parser.add_argument("--merge", nargs="+", default=None, help="result files: print their runs' ratios, run nothing")
    record.add_arguments(parser)
    args = parser.parse_args()
    if args.merge:
        results = {}
        for path in args.merge:
            kept = json.loads(Path(path).read_text())["results"]
            for label, runs in kept.get("runs", kept).items():  # a record, or a file of before records
                results.setdefault(label, {}).update(runs)
        report(results, args)
        return 0
    tokenizer = load_tokenizer(default_model_path())
    sentences = load_sentences()
    makers = {"shared-prefix": shared_prefix_load, "no-reuse": no_reuse_load}
    loads = {}
    for name in args.workloads.split(","):
        rng = random.Random(args.seed)

        def prompt(n, rng=rng):
            return text_of_tokens(rng, sentences, n, lambda t: tokenizer.encode(t, add_special_tokens=False),
                                  tokenizer.decode)[1]

        loads[name] = makers[name](rng, prompt, args)
    if "shared-prefix" in loads:
        args.ceiling = shared_prefix_ceiling(args, None if args.client == "vllm" else loads["shared-prefix"])
    if args.log_dir:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    if args.client == "vllm" and vllm_client.available():
        raise SystemExit(f"--client vllm: {vllm_client.available()}")
    print(f"CPU: {describe_cpu()}", flush=True)
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        args.vllm_results = args.log_dir or scratch  # vLLM's client's result files
        for mode in filter(None, args.policies.split(",")):  # "": only --reference / --fault runs
            results[mode] = run(mode, loads, args, mode)
        if args.reference and "shared-prefix" in loads:
            results["reference"] = run("reference", {"shared-prefix": loads["shared-prefix"]}, args, dp=1,
                                       blocks=2 * args.num_gpu_blocks)
        if args.fault and "shared-prefix" in loads:
            results["kv-faults"] = run("kv-faults", {"shared-prefix": loads["shared-prefix"]}, args, fault=True)
    got = report(results, args)
    config = {k: v for k, v in vars(args).items()
              if k not in ("merge", "record", "result_file", "log_dir", "vllm_results", "ceiling")}
    question = "routing-vllm-client" if args.client == "vllm" else "routing"
    record.save(record.Record("routing", question, config=config, results={
        "table": table(results), "targets": targets(got), "ratios": got, "runs": results}), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
