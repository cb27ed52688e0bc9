"""Fault injection on a real stack: kill -9 one service at a time under concurrent streams.

One stack for the module (nats-server with authentication, a worker, a scheduler, 2
tokenizers, 2 detokenizers, a gateway), supervised by the launcher as under
``scripts/serve``. Under ``STREAMS`` concurrent greedy streams we kill a tokenizer
replica, a detokenizer replica, the worker and the scheduler in turn: none costs
any text (every stream ends with the text an undisturbed run gives, no token twice;
the scheduler's streams resume on its restarted incarnation); after each the stack
serves again without a human, and the engine ends idle with no KV block held. Before that, a short soak of random requests with clients leaving early.
Then the launcher itself: SIGKILL leaves no service behind, SIGTERM stops TP=3 in 10 s.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from services.launch.nats_server import free_port
from tests.e2e.stacks import metric, replicated_config, running_stack, stream_or_error, wait_until

ROOT = Path(__file__).resolve().parents[2]
MODEL = "SmolLM2-135M-Instruct"
STREAMS = 16
MAX_TOKENS = 24
QUESTIONS = [f"Tell me fact number {i} about the sea." for i in range(STREAMS)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    args = ["--max-num-seqs", "32", "--num-gpu-blocks", "512", "--worker-timeout", "3"]
    with running_stack(replicated_config(tmp_path_factory.mktemp("fault-logs"), args)) as stack:
        yield stack


async def stream_text(http: httpx.AsyncClient, question: str, started: asyncio.Event | None = None):
    """The streamed text, or the error event that ended it."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True}
    return await stream_or_error(http, "/v1/chat/completions", body, started)


async def run_streams(stack, fault=None, at_once: bool = False) -> tuple[list, float]:
    """``STREAMS`` concurrent streams; ``fault()`` runs once the first token is out (with
    ``at_once``, as the requests leave: while tokenizers hold them). Returns the outcomes
    and the seconds from the fault to the last stream's end."""
    started = asyncio.Event()
    if at_once:
        started.set()
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as http:
        tasks = [asyncio.ensure_future(stream_text(http, q, started)) for q in QUESTIONS]
        faulted_at = time.monotonic()
        if fault is not None:
            await asyncio.sleep(0.05 if at_once else 0)
            await asyncio.wait_for(started.wait(), 60)
            faulted_at = time.monotonic()
            fault()
        outcomes = await asyncio.gather(*tasks)
    return outcomes, time.monotonic() - faulted_at


def assert_idle_and_serving(stack):
    """Nothing leaks: the engine ends with no request and no KV block; it serves again."""
    wait_until(lambda: httpx.get(stack.base_url + "/health", timeout=5).status_code == 200, 120, "not healthy again")
    wait_until(lambda: metric(stack, "natsllm:num_requests_running") == 0
               and metric(stack, "natsllm:num_requests_waiting") == 0
               and metric(stack, "natsllm:kv_cache_usage_perc") == 0.0, 30, "requests or KV blocks left over")


# (seed, requests) of the warm-up round and of the measured round. CI runs the short soak;
# the longer one is marked slow (`scripts/test -m slow`), scripts/soak.py runs thousands.
SHORT_SOAK = ((1, 30), (7, 60))
LONG_SOAK = ((1, 60), (7, 150))


@pytest.mark.parametrize("rounds", [pytest.param(SHORT_SOAK, id="short"),
                                    pytest.param(LONG_SOAK, id="long", marks=pytest.mark.slow)])
def test_soak_random_requests_and_disconnects_leave_nothing_behind(stack, rounds):
    """A short soak: random shapes, n, stop strings, clients that leave early; afterwards
    no request or KV block is left in the engine and no service grew much."""
    from scripts.soak import rss_mib, soak, wait_idle

    # A first round warms up (allocator and oneDNN caches grow with new batch shapes);
    # memory is compared over the second.
    measured = []
    for seed, count in rounds:
        rss = {name: rss_mib(p.pid) for name, p in stack.processes.items()}
        result = asyncio.run(soak(stack.base_url, MODEL, num_requests=count, concurrency=12, seed=seed,
                                  max_seconds=300))
        assert result.errors == []
        assert result.completed + result.disconnected == count and result.disconnected > 0
        gauges = wait_idle(stack.base_url)
        assert gauges and not any(gauges.values()), gauges
        measured.append(rss)
    growth = {name: rss_mib(p.pid) - measured[1][name] for name, p in stack.processes.items()}
    print("RSS growth over the measured round (MiB):", growth)
    # The Python services hold per-request state only while a request lives. The worker
    # also grows oneDNN's primitive cache and torch's allocator with each new batch
    # shape, for longer than a short run: its RSS is watched by the long soak
    # (scripts/soak.py, figures in docs/BENCHMARKS.md), not asserted here.
    assert all(mib < 30 for name, mib in growth.items() if not name.startswith("worker")), growth


@pytest.fixture(scope="module")
def undisturbed(stack):
    outcomes, _ = asyncio.run(run_streams(stack))
    assert all(isinstance(o, str) and o for o in outcomes), outcomes
    return outcomes


@pytest.mark.parametrize("victim", ["tokenizer-0", "detokenizer-0", "worker-0"])
def test_killing_a_stateless_replica_or_the_worker_costs_no_text(stack, undisturbed, victim):
    restarts = stack.supervisor.restart_counts()[victim]
    fault = lambda: stack.supervisor.kill(victim)  # noqa: E731
    outcomes, _ = asyncio.run(run_streams(stack, fault, at_once=victim.startswith("tokenizer")))
    assert outcomes == undisturbed
    wait_until(lambda: stack.supervisor.restart_counts()[victim] == restarts + 1, 30, f"{victim} not restarted")
    assert_idle_and_serving(stack)
    assert metric(stack, f'natsllm:service_restarts_total{{service="{victim}"}}') >= 1


def test_killing_the_only_scheduler_costs_no_text(stack, undisturbed):
    """The one engine's scheduler dies with every stream in flight: the gateway sees its
    restarted incarnation and sends each request again with the tokens its client has;
    the new scheduler recomputes them and every stream ends with the undisturbed text."""
    resumed = metric(stack, "natsllm:requests_resumed_total")
    outcomes, ended_after = asyncio.run(run_streams(stack, fault=lambda: stack.supervisor.kill("scheduler")))
    print(f"the scheduler's streams ended {ended_after:.1f}s after its kill")
    assert outcomes == undisturbed
    assert metric(stack, "natsllm:requests_resumed_total") > resumed  # streams were in flight
    assert_idle_and_serving(stack)


# Requests whose features a resume must keep: a stop string, n=2 seeded sampling (the
# resumed samples' generators skip the draws of the tokens they bring), logprobs, a JSON
# constraint (the workers' grammar matchers replay the outputs).
FEATURE_REQUESTS = [
    ("/v1/completions", {"prompt": "The list of colors: red, green,", "max_tokens": 32, "temperature": 0,
                         "stop": [" purple"]}),
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 32, "n": 2, "seed": 11, "temperature": 0.9}),
    ("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 32, "temperature": 0, "logprobs": 2,
                         "ignore_eos": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Describe a cat as JSON."}], "max_tokens": 32,
                              "temperature": 0, "response_format": {"type": "json_object"}}),
]


def choices_of(response: dict) -> list:
    """What must not change: each choice's text (or message), finish reason and logprob tokens."""
    out = []
    for choice in sorted(response["choices"], key=lambda c: c["index"]):
        logprobs = choice.get("logprobs") or {}
        out.append((choice.get("text", (choice.get("message") or {}).get("content")), choice["finish_reason"],
                    logprobs.get("tokens")))
    return out


async def run_features(stack, fault=None) -> list:
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as http:
        tasks = [asyncio.ensure_future(http.post(path, json={"model": MODEL, **body}))
                 for path, body in FEATURE_REQUESTS]
        if fault is not None:
            # Mid-generation: some tokens are out, none of the requests is done.
            start = await asyncio.to_thread(metric, stack, "natsllm:generation_tokens_total")
            deadline = time.monotonic() + 60
            while await asyncio.to_thread(metric, stack, "natsllm:generation_tokens_total") < start + 12:
                assert time.monotonic() < deadline, "no tokens came"
                await asyncio.sleep(0.1)
            fault()
        responses = await asyncio.gather(*tasks)
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    return [choices_of(r.json()) for r in responses]


def test_a_resumed_request_keeps_its_stop_strings_seeds_logprobs_and_grammar(stack):
    undisturbed = asyncio.run(run_features(stack))
    resumed = metric(stack, "natsllm:requests_resumed_total")
    outcomes = asyncio.run(run_features(stack, fault=lambda: stack.supervisor.kill("scheduler")))
    assert metric(stack, "natsllm:requests_resumed_total") > resumed
    assert outcomes == undisturbed
    assert_idle_and_serving(stack)


def launcher_children(pid: int) -> list[int]:
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return children


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def start_launcher(tmp_path, *flags) -> tuple[subprocess.Popen, int]:
    port = free_port()
    log = open(tmp_path / "launcher.log", "wb")
    launcher = subprocess.Popen([sys.executable, "scripts/launch.py", "--port", str(port), *flags], cwd=ROOT,
                                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "LOG_LEVEL": "WARNING"})
    wait_until(lambda: launcher.poll() is None and _healthy(port), 240, "the launcher's stack did not come up")
    return launcher, port


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_sigkilled_launcher_leaves_no_service(tmp_path):
    launcher, _ = start_launcher(tmp_path)
    children = launcher_children(launcher.pid)
    assert len(children) >= 6  # nats-server, worker, scheduler, tokenizer, detokenizer, gateway
    launcher.kill()
    launcher.wait()
    wait_until(lambda: not any(alive(pid) for pid in children), 10, "services outlived the launcher")


def test_sigterm_stops_a_tp3_stack_within_10s(tmp_path):
    launcher, _ = start_launcher(tmp_path, "--tp", "3", "--cpu-kv-cache-gib", "0.05")
    children = launcher_children(launcher.pid)
    start = time.monotonic()
    launcher.send_signal(signal.SIGTERM)
    launcher.wait(timeout=15)
    assert time.monotonic() - start < 10
    assert not any(alive(pid) for pid in children)
