"""Per-step time profile of the engine at batch 1, 8, 32 and 128 decode.

Starts nats-server, a worker and a scheduler with ``--profile-steps``, feeds
tokenized requests straight to the scheduler (no gateway/tokenizer: this measures
the engine's step loop), and for each batch size lets that many requests decode,
then prints the median time of every phase of a step and the share that is not
the forward pass and sampling. It also times the bare NATS round trip of a step
message of each batch size (to an echo process and back), apart from the asyncio
and thread hops that the bus_round_trip phase includes.

    .venv/bin/python scripts/bench_overhead.py [--batches 1 8 32 128] [--steps 30] [--temperature 0.7 --top-p 0.9]
        [engine flags, e.g. --dtype bfloat16]

The requests are greedy unless --temperature (and --top-p, --top-k) say otherwise: the
"sampling" phase against the whole step is what sampled requests cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import nats

from bench import record

from services.launch.nats_server import NatsServer
from services.launch.stack import Stack, StackConfig
from shared.bus import flush_in_order
from shared.protocol import (
    ABORT_REQUEST,
    ENGINE_REQUEST,
    ENGINE_REQUEST_REPLY,
    ENGINE_REQUESTS,
    SCHEDULER_OUTPUT,
    AbortRequest,
    CachedRequestData,
    EngineRequest,
    SamplingParams,
    SchedulerOutput,
    engine_abort_subject,
    engine_profile_subject,
)
from shared.step_profile import WORKER_PHASES

BENCH_GATEWAY = "bench"  # the gateway id the benchmark's requests (and their aborts) name
# In the order a step goes through them.
ENGINE_PHASES = [
    "idle", "schedule", "encode", "bus_round_trip", *WORKER_PHASES, "result_decode", "update", "publish_outputs",
]


class EngineOnly(Stack):
    """nats-server, one worker and the scheduler: the engine's step loop alone."""

    def start(self) -> None:
        self.nats = NatsServer(log_file=f"{self.config.log_dir}/nats.log")
        self.start_service("worker-0", "services.worker", ["--profile-steps", *self.service_args["worker"]])
        self.start_service("scheduler", "services.scheduler", ["--profile-steps", *self.service_args["scheduler"]])


async def profile_batch(nc, batch: int, steps: int, prompt_len: int, sampling: dict) -> dict:
    subject = engine_profile_subject("0")
    ids = [f"bench-{batch}-{i}-{uuid.uuid4().hex[:6]}" for i in range(batch)]
    params = SamplingParams(max_tokens=100_000, ignore_eos=True, **sampling)
    for i, req_id in enumerate(ids):
        prompt = [(i * 7 + j) % 1000 + 100 for j in range(prompt_len)]  # distinct: no prefix hits
        request = EngineRequest(req_id, prompt, params, gateway_id=BENCH_GATEWAY)
        reply = await nc.request(ENGINE_REQUESTS, ENGINE_REQUEST.encode(request), timeout=10)
        error = ENGINE_REQUEST_REPLY.decode(reply.data).error
        if error:
            raise RuntimeError(error.message)
    try:
        # Let every prompt finish prefilling, then measure decode-only steps.
        await asyncio.sleep(1.0)
        await nc.request(subject, json.dumps({"reset": True}).encode(), timeout=5)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            summary = json.loads((await nc.request(subject, json.dumps({"num_reqs": batch}).encode(), timeout=5)).data)
            if summary["num_steps"] >= steps:
                return summary
        raise TimeoutError(f"batch {batch}: fewer than {steps} steps in 600 s")
    finally:
        await nc.publish(engine_abort_subject(BENCH_GATEWAY), ABORT_REQUEST.encode(AbortRequest(ids)))
        await flush_in_order(nc)
        await asyncio.sleep(1.0)


ECHO = """
import asyncio, sys, nats
from shared.bus import flush_in_order
async def main():
    nc = await nats.connect(sys.argv[1])
    async def echo(msg):
        await nc.publish("bench.echo.back", msg.data)
    await nc.subscribe("bench.echo", cb=echo)
    # shared.bus.flush_in_order's two round trips (this process does not import the project)
    await nc.flush()
    await nc.flush()
    print("ready", flush=True)
    await asyncio.sleep(3600)
asyncio.run(main())
"""


def decode_step_message(batch: int) -> bytes:
    """A decode step of ``batch`` requests as the scheduler encodes it."""
    ids = [f"req-{i:04d}-{uuid.uuid4().hex[:8]}" for i in range(batch)]
    step = SchedulerOutput(
        step_id=1000,
        scheduled_cached_reqs=CachedRequestData(ids, [False] * batch, [[[]]] * batch, [300] * batch),
        scheduled_req_ids=ids,
        num_scheduled_tokens=[1] * batch,
        total_num_scheduled_tokens=batch,
    )
    return SCHEDULER_OUTPUT.encode(step)


async def nats_echo_rtt(nc, batch: int, repeats: int = 300) -> tuple[float, int]:
    """Median round trip (ms) of a step message to another process and back."""
    data = decode_step_message(batch)
    replies: asyncio.Queue = asyncio.Queue()

    async def on_reply(msg):
        replies.put_nowait(msg)

    sub = await nc.subscribe("bench.echo.back", cb=on_reply)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        await nc.publish("bench.echo", data)
        await replies.get()
        times.append(time.perf_counter() - start)
    await sub.unsubscribe()
    return statistics.median(times) * 1e3, len(data)


async def run(url: str, batches: list[int], steps: int, prompt_len: int, sampling: dict) -> list[tuple[int, dict]]:
    nc = await nats.connect(url)
    echo = subprocess.Popen([sys.executable, "-c", ECHO, url], stdout=subprocess.PIPE, text=True)
    echo.stdout.readline()
    results = []
    try:
        for batch in batches:
            summary = await profile_batch(nc, batch, steps, prompt_len, sampling)
            summary["nats_echo_ms"], summary["step_message_bytes"] = await nats_echo_rtt(nc, batch)
            results.append((batch, summary))
    finally:
        echo.kill()
        await nc.close()
    return results


def print_table(results: list[tuple[int, dict]]) -> None:
    header = "| phase (median ms) | " + " | ".join(f"batch {b}" for b, _ in results) + " |"
    print(header)
    print("|---" * (len(results) + 1) + "|")
    for phase in ENGINE_PHASES:
        cells = [f"{r['median_ms'].get(phase, 0.0):.3f}" for _, r in results]
        print(f"| {phase} | " + " | ".join(cells) + " |")
    print("| NATS round trip of the step message (echo, ms) | " + " | ".join(f"{r['nats_echo_ms']:.3f}" for _, r in results) + " |")
    print("| step message size (bytes) | " + " | ".join(str(r["step_message_bytes"]) for _, r in results) + " |")
    print("| **step** | " + " | ".join(f"{r['median_step_ms']:.2f}" for _, r in results) + " |")
    print("| **not forward/sampling** | " + " | ".join(f"{100 * r['overhead_share']:.1f}%" for _, r in results) + " |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--steps", type=int, default=30, help="decode steps measured per batch size")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.0, help="the requests' (0: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    record.add_arguments(parser)
    args, engine_args = parser.parse_known_args()
    given_flags = list(engine_args)
    sampling = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    # Defaults first: flags given on the command line come later and win.
    engine_args = ["--max-num-seqs", str(max(args.batches)), "--num-gpu-blocks", "4096", *engine_args]
    with tempfile.TemporaryDirectory() as logs:
        stack = EngineOnly(StackConfig(args=engine_args, log_dir=logs))
        stack.start()
        try:
            deadline = time.monotonic() + 300
            while not stack.engine_ready():
                if stack.dead_services() or time.monotonic() > deadline:
                    raise RuntimeError(f"engine did not start: {stack.dead_services()}")
                time.sleep(0.5)
            results = asyncio.run(run(stack.nats.url, args.batches, args.steps, args.prompt_len, sampling))
        finally:
            stack.stop()
    print_table(results)
    table = [{"batch": b, "step ms": r["median_step_ms"], "forward ms": r["median_ms"].get("forward"),
              "not forward/sampling": f"{100 * r['overhead_share']:.1f}%"} for b, r in results]
    config = {**{k: v for k, v in vars(args).items() if k not in ("record", "result_file")},
              "engine_flags": given_flags}
    record.save(record.Record("overhead", "step-overhead", config=config,
                              results={"table": table, "by_batch": {str(b): r for b, r in results}}), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
