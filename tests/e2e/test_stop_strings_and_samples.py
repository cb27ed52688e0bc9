"""A whole stack: a prompt's n samples prepared once; stop strings a late detokenizer never heard.

One stack for the module (nats-server with authentication, a worker, a scheduler with
``--max-num-seqs 1`` so that a second request waits, one tokenizer, one detokenizer, a
gateway), each a real process. The tokenizer prepares a prompt with ``n=3`` once, and
each choice equals the request with ``seed + i`` and ``n=1``. A detokenizer replica
started after a request with a stop string was accepted (it missed the scheduler's
broadcast) asks the scheduler for it, and the client's text ends where an undisturbed
run's text shows the stop string.
"""

from __future__ import annotations

import asyncio

import httpx
import nats
import pytest

from shared.protocol import PONG, ping_subject
from tests.e2e.stacks import metric, running_stack, wait_until
from services.launch.nats_server import free_port
from services.launch.stack import StackConfig

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "Write a long story about a lighthouse keeper and the sea."


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    args = ["--max-num-seqs", "1", "--num-gpu-blocks", "512"]
    config = StackConfig(port=free_port(), args=args, log_dir=str(tmp_path_factory.mktemp("stop-logs")))
    with running_stack(config) as stack:
        yield stack


def ping(stack, service: str) -> dict:
    """The health ping's answer of (one replica of) ``service``: its instance id and info."""
    async def ask():
        nc = await nats.connect(stack.nats.url, **stack.nats.credentials("admin"))
        try:
            pong = PONG.decode((await nc.request(ping_subject(service), b"", timeout=2)).data)
            return {"instance_id": pong.instance_id, **pong.info}
        finally:
            await nc.close()

    return asyncio.run(ask())


def chat(stack, **fields) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], **fields}
    r = httpx.post(stack.base_url + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_n_samples_are_prepared_once_and_each_equals_its_seed(stack):
    chat(stack, max_tokens=1)  # the prompt's blocks are cached for every run below alike
    sampled = dict(temperature=1.0, max_tokens=12)
    before = ping(stack, "tokenizer")["num_requests"]
    r = chat(stack, n=3, seed=123, **sampled)
    assert ping(stack, "tokenizer")["num_requests"] == before + 1  # one prompt, prepared once
    texts = [c["message"]["content"] for c in sorted(r["choices"], key=lambda c: c["index"])]
    assert len(texts) == 3 and len(set(texts)) == 3
    assert r["usage"]["completion_tokens"] == 36
    singles = [chat(stack, seed=123 + i, **sampled)["choices"][0]["message"]["content"] for i in range(3)]
    assert singles == texts


async def stream_chat(http: httpx.AsyncClient, started: asyncio.Event, **fields) -> tuple[str, str | None]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "stream": True,
            "temperature": 0, "ignore_eos": True, **fields}
    text, finish = [], None
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = httpx.Response(200, content=line[len("data: "):]).json()
            assert "error" not in event, event
            choice = event["choices"][0]
            if choice["delta"].get("content"):
                text.append(choice["delta"]["content"])
                started.set()
            finish = choice.get("finish_reason") or finish
    return "".join(text), finish


def test_a_detokenizer_started_after_the_request_asks_for_its_stop_strings(stack):
    reference = chat(stack, temperature=0, max_tokens=40, ignore_eos=True)["choices"][0]["message"]["content"]
    words = reference.split()
    # A word from the second half whose first appearance is there too.
    stop = next(" " + w for w in words[len(words) // 2:] if reference.index(" " + w) > len(reference) // 3)
    expected = reference[: reference.index(stop)]
    old_detokenizer = ping(stack, "detokenizer")["instance_id"]

    async def run() -> tuple[str, str | None]:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=300) as http:
            blocker_started = asyncio.Event()
            # Holds the engine's only place (--max-num-seqs 1) until it is cancelled.
            blocker = asyncio.ensure_future(stream_chat(http, blocker_started, max_tokens=4000))
            await asyncio.wait_for(blocker_started.wait(), 120)
            stopped = asyncio.ensure_future(stream_chat(http, asyncio.Event(), max_tokens=40, stop=[stop]))
            # Accepted (its stop strings broadcast), waiting behind the blocker.
            await asyncio.to_thread(wait_until, lambda: metric(stack, "natsllm:num_requests_waiting") == 1, 30,
                                    "the request with a stop string was not queued")
            # The only detokenizer dies; the one that replaces it never heard the broadcast.
            stack.supervisor.kill("detokenizer-0")
            await asyncio.to_thread(wait_until, lambda: ping_or_none(stack) not in (None, old_detokenizer), 60,
                                    "no new detokenizer came up")
            blocker.cancel()  # the client leaves: the engine aborts it, the waiting request runs
            return await asyncio.wait_for(stopped, 120)

    text, finish = asyncio.run(run())
    assert (text, finish) == (expected, "stop")
    assert ping(stack, "detokenizer")["num_stop_queries"] >= 1
    assert ping(stack, "scheduler")["num_stop_queries"] >= 1
    wait_until(lambda: metric(stack, "natsllm:num_requests_running") == 0
               and metric(stack, "natsllm:kv_cache_usage_perc") == 0.0, 30, "requests or KV blocks left over")


def ping_or_none(stack) -> str | None:
    try:
        return ping(stack, "detokenizer")["instance_id"]
    except Exception:
        return None
