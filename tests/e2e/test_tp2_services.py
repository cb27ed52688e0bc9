"""TP=2 through the real services on a tiny random Llama (4 heads, 2 KV heads).

Greedy output equals TP=1 (the in-process engine on the same weights). Then a
rank dies mid-stream: the stream ends with an error within seconds, new requests
get 503 while the engine is broken, and once both ranks are back it serves again.
"""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from services.launch.nats_server import free_port
from services.launch.stack import StackConfig
from tests.e2e.stacks import running_stack
from tests.hf_reference import make_tiny_random_llama


@pytest.fixture(scope="module")
def tp_stack(tmp_path_factory):
    model = make_tiny_random_llama(tmp_path_factory.mktemp("tiny-tp"), seed=1, num_heads=4, num_kv_heads=2)
    config = StackConfig(port=free_port(), model=str(model), tensor_parallel_size=2,
                         args=["--num-gpu-blocks", "256"], log_dir=str(tmp_path_factory.mktemp("tp-logs")))
    with running_stack(config) as stack:
        yield stack, os.path.basename(str(model)), str(model)


def chat(stack, model, **fields):
    body = {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, **fields}
    return httpx.post(stack.base_url + "/v1/chat/completions", json=body, timeout=60)


def test_tp2_greedy_equals_tp1(tp_stack):
    stack, model, path = tp_stack
    from services.engine import Engine
    from shared.config import CacheConfig, ModelRunConfig
    from shared.protocol import SamplingParams

    engine = Engine(ModelRunConfig(model=path), CacheConfig(num_gpu_blocks=64))
    questions = ["hello there", "what is two plus two", "tell me a story about a fox"]
    for q in questions:
        prompt = engine.tokenizer.encode(
            engine.tokenizer.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False
        )
        want = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
        resp = chat(stack, model, messages=[{"role": "user", "content": q}], max_tokens=16,
                    temperature=0, ignore_eos=True, logprobs=True)
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        assert choice["message"]["content"] == engine.tokenizer.decode(want.token_ids).rstrip("\ufffd")
        assert len(choice["logprobs"]["content"]) == 16


def test_dead_rank_fails_requests_then_503_until_whole_again(tp_stack):
    stack, model, _ = tp_stack
    assert chat(stack, model).status_code == 200

    body = {"model": model, "messages": [{"role": "user", "content": "go on"}], "stream": True,
            "max_tokens": 1500, "ignore_eos": True, "temperature": 0}
    events = []
    with httpx.Client(timeout=60) as http, http.stream("POST", stack.base_url + "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        killed_at = None
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if len(events) == 3:
                os.killpg(stack.processes["worker-1"].pid, signal.SIGKILL)
                killed_at = time.monotonic()
            if line == "data: [DONE]":
                break
        ended_after = time.monotonic() - killed_at
    errors = [json.loads(e)["error"] for e in events if e != "[DONE]" and "error" in json.loads(e)]
    assert len(errors) == 1, events[-3:]
    assert "worker" in errors[0]["message"] or "engine" in errors[0]["message"]
    # Bounded by the worker heartbeat timeout (5 s), not by a step or request timeout.
    assert ended_after < 20

    # Broken engine: new requests are refused at once with 503.
    deadline = time.monotonic() + 20
    status = None
    while time.monotonic() < deadline:
        status = chat(stack, model).status_code
        if status == 503:
            break
        time.sleep(0.5)
    assert status == 503

    # Rank 0 exits by itself (its process group is broken); restart both ranks.
    stack.processes["worker-0"].wait(timeout=30)
    assert stack.processes["worker-0"].returncode != 0
    stack.restart_service("worker-0")
    stack.restart_service("worker-1")
    deadline = time.monotonic() + 120
    while not stack.engine_ready():
        assert time.monotonic() < deadline, "engine not whole again"
        time.sleep(0.5)
    resp = chat(stack, model)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["finish_reason"] in ("length", "stop")
