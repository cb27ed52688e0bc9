"""Soak a running stack (or one it starts): many requests with random shapes and random
client disconnects, then check that nothing is stuck or leaked.

    .venv/bin/python scripts/soak.py --requests 2000 --concurrency 16
    .venv/bin/python scripts/soak.py --base-url http://127.0.0.1:8000 --requests 500

Each request is chat or completion, streamed or not, with a random ``n`` (1-3),
``max_tokens`` (1-24), stop strings, temperature and seed; about one in eight clients
goes away early (after the first chunk, or by a short timeout), which aborts the
request in the engine. Afterwards the engine must report no running or waiting request
and no KV block in use within a deadline; the services' memory (RSS) before and after
is printed. Only loopback addresses are used; the run is bounded in count and time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The worker gives its free heap pages back after 2 s idle (services/worker/heap_trim.py).
RSS_SETTLE_SECONDS = 5.0

WORDS = "the a sea ship wind stone river light . , and of".split()


@dataclass
class SoakResult:
    completed: int = 0
    disconnected: int = 0
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0


def random_body(rng: random.Random, model: str) -> tuple[str, dict]:
    chat = rng.random() < 0.5
    body = {"model": model, "max_tokens": rng.randint(1, 24), "n": rng.choice([1, 1, 2, 3]),
            "stream": rng.random() < 0.6}
    if rng.random() < 0.5:
        body["temperature"] = 0
    else:
        body["temperature"], body["seed"] = 0.8, rng.randint(0, 1000)
    if rng.random() < 0.4:
        body["stop"] = rng.sample(WORDS, rng.randint(1, 3))
    text = " ".join(rng.choices(WORDS, k=rng.randint(1, 30)))
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
        return "/v1/chat/completions", body
    body["prompt"] = text
    return "/v1/completions", body


async def one_request(http: httpx.AsyncClient, rng: random.Random, model: str, result: SoakResult) -> None:
    route, body = random_body(rng, model)
    leave_early = rng.random() < 0.125
    try:
        if body["stream"]:
            async with http.stream("POST", route, json=body) as r:
                if r.status_code != 200:
                    result.errors.append(f"{r.status_code}: {(await r.aread())[:200]!r}")
                    return
                async for line in r.aiter_lines():
                    if leave_early and line.startswith("data: {"):
                        result.disconnected += 1
                        return  # closing the stream is the client going away
                    if line.startswith("data: {") and '"error"' in line:
                        result.errors.append(line[:200])
                        return
        else:
            timeout = 0.2 if leave_early else 120
            r = await http.post(route, json=body, timeout=timeout)
            if r.status_code != 200:
                result.errors.append(f"{r.status_code}: {r.text[:200]}")
                return
            assert len(r.json()["choices"]) == body["n"]
        result.completed += 1
    except httpx.TimeoutException:
        if not leave_early:
            result.errors.append(f"timeout: {json.dumps(body)[:200]}")
        else:
            result.disconnected += 1


async def soak(base_url: str, model: str, num_requests: int, concurrency: int, seed: int,
               max_seconds: float) -> SoakResult:
    rng = random.Random(seed)
    result = SoakResult()
    start = time.monotonic()
    queue = list(range(num_requests))
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
        async def client(index: int) -> None:
            local = random.Random(rng.random() + index)
            while queue and time.monotonic() - start < max_seconds:
                queue.pop()
                await one_request(http, local, model, result)

        await asyncio.gather(*(client(i) for i in range(concurrency)))
    result.seconds = time.monotonic() - start
    return result


def engine_gauges(base_url: str, headers: dict | None = None) -> dict[str, float]:
    """Requests running and waiting and the KV cache's use, summed over the engines (one
    labelled series each when there are several)."""
    text = httpx.get(base_url + "/metrics", timeout=10, headers=headers or {}).text
    wanted = ("natsllm:num_requests_running", "natsllm:num_requests_waiting", "natsllm:kv_cache_usage_perc")
    values: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


def wait_idle(base_url: str, timeout: float = 30.0) -> dict[str, float]:
    """The engine's gauges once all are 0, or as they are at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        gauges = engine_gauges(base_url)
        if (gauges and not any(gauges.values())) or time.monotonic() > deadline:
            return gauges
        time.sleep(0.5)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", help="a running stack (default: start one here)")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-seconds", type=float, default=3600)
    parser.add_argument("--rounds", type=int, default=1,
                        help="repeat the run; RSS is printed after each round (a leak grows every round)")
    args = parser.parse_args()

    stack = None
    base_url = args.base_url
    if base_url is None:
        from services.launch.nats_server import free_port
        from services.launch.stack import Stack, StackConfig

        stack = Stack(StackConfig(port=free_port(), num_tokenizers=2, num_detokenizers=2,
                                  args=["--max-num-seqs", "64"], log_dir=None))
        stack.start()
        stack.wait_ready()
        base_url = stack.base_url
    try:
        rss_before = {n: rss_mib(p.pid) for n, p in stack.processes.items()} if stack else {}
        failed = False
        for round_index in range(args.rounds):
            result = asyncio.run(soak(base_url, args.model, args.requests, args.concurrency,
                                      args.seed + round_index, args.max_seconds))
            gauges = wait_idle(base_url)
            time.sleep(RSS_SETTLE_SECONDS)
            rss_after = {n: rss_mib(p.pid) for n, p in stack.processes.items()} if stack else {}
            print(f"round {round_index + 1}: {result.completed} completed, {result.disconnected} clients left "
                  f"early, {len(result.errors)} errors in {result.seconds:.0f}s; load average "
                  f"{' '.join(f'{v:.1f}' for v in os.getloadavg())} (1, 5, 15 min)", flush=True)
            for error in result.errors[:10]:
                print("  error:", error)
            print("engine when idle:", gauges)
            for name in rss_before:
                print(f"  {name:14s} RSS {rss_before[name]:7.0f} MiB -> {rss_after.get(name, 0):7.0f} MiB", flush=True)
            failed = failed or bool(result.errors) or any(gauges.values()) or not gauges
    finally:
        if stack is not None:
            stack.stop()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
