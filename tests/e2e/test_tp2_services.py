"""TP=2 through the real services on a tiny random Llama (4 heads, 2 KV heads).

Greedy output equals TP=1 (the in-process engine on the same weights). Then a
rank dies mid-stream: the launcher restarts the group and the stream goes on with
the text an undisturbed run gives.
"""

from __future__ import annotations

import json
import os

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

    engine = Engine(ModelRunConfig(model=path, dtype="float32", quantization="none"), CacheConfig(num_gpu_blocks=64))
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


def stream_text(stack, model, kill_after_events: int | None = None) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": "go on"}], "stream": True,
            "max_tokens": 200, "ignore_eos": True, "temperature": 0}
    text, events = [], 0
    with httpx.Client(timeout=120) as http, http.stream("POST", stack.base_url + "/v1/chat/completions",
                                                        json=body) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            text.append(event["choices"][0]["delta"].get("content") or "")
            events += 1
            if events == kill_after_events:
                stack.supervisor.kill("worker-1")
    return "".join(text)


def test_a_dead_rank_costs_no_text_and_the_group_restarts_by_itself(tp_stack):
    stack, model, _ = tp_stack
    undisturbed = stream_text(stack, model)
    restarts = stack.supervisor.restart_counts()
    # Rank 1 dies mid-stream: rank 0 notices its peer and exits too, the launcher restarts
    # both, the scheduler resumes the request on the new group (prompt + tokens so far).
    assert stream_text(stack, model, kill_after_events=3) == undisturbed
    after = stack.supervisor.restart_counts()
    assert after["worker-1"] == restarts["worker-1"] + 1
    assert after["worker-0"] == restarts["worker-0"] + 1
    resp = chat(stack, model)
    assert resp.status_code == 200, resp.text
