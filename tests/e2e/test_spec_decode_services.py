"""Speculative decoding through the real services, TP=2, on a tiny random Llama.

Every service a real process; the two worker ranks propose their drafts on their own,
by n-gram lookup or with a draft model (a noisy copy of the target, whole on each rank).
Greedy output equals the single-process engine's without speculative decoding, token
for token (the ranks proposed alike, or their collectives would have mixed different
inputs); streams carry every token once and in order, a stop string inside an accepted
run cuts exactly there, max_tokens holds, and the drafts show in /metrics.
"""

from __future__ import annotations

import json
import os
import urllib.request

import httpx
import pytest

from services.detokenizer.incremental import IncrementalDetokenizer
from services.engine import Engine
from services.launch.nats_server import free_port
from services.launch.stack import StackConfig
from shared.config import CacheConfig, ModelRunConfig
from shared.protocol import SamplingParams
from tests.draft_models import write_draft_model
from tests.e2e.stacks import running_stack
from tests.hf_reference import make_tiny_random_llama

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
QUESTIONS = ["hello there", "what is two plus two", "tell me a story about a fox", "a b c a b c a b"]
NUM_TOKENS = 48


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(make_tiny_random_llama(tmp_path_factory.mktemp("tiny-spec"), seed=1, num_heads=4, num_kv_heads=2))


@pytest.fixture(scope="module", params=["ngram", "draft_model"])
def speculative_config(request, tmp_path_factory, model_path):
    if request.param == "ngram":
        return NGRAM
    draft = write_draft_model(model_path, tmp_path_factory.mktemp("tiny-draft"), layers=[0, 1], noise=0.3, seed=1)
    return json.dumps({"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3})


@pytest.fixture(scope="module")
def stack(tmp_path_factory, model_path, speculative_config):
    config = StackConfig(port=free_port(), model=model_path, tensor_parallel_size=2,
                         args=["--num-gpu-blocks", "256", "--speculative-config", speculative_config],
                         log_dir=str(tmp_path_factory.mktemp("spec-logs")))
    with running_stack(config) as stack:
        yield stack


@pytest.fixture(scope="module")
def reference(model_path):
    """Greedy token ids of each question, TP=1, no speculative decoding."""
    engine = Engine(ModelRunConfig(model=model_path, dtype="float32", quantization="none"), CacheConfig(num_gpu_blocks=64))
    tokenizer = engine.tokenizer
    out = {}
    for q in QUESTIONS:
        prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]),
                                  add_special_tokens=False)
        params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
        out[q] = engine.generate([prompt], params)[0].token_ids
    detokenizer = IncrementalDetokenizer(tokenizer)
    # Each token's raw bytes, as the logprobs of a response carry them: a random model's
    # text is full of broken UTF-8, its tokens' bytes are exact.
    return {q: [list(detokenizer.token_bytes(t)) for t in ids] for q, ids in out.items()}


def chat(stack, model_path, question, **fields):
    body = {"model": os.path.basename(model_path), "messages": [{"role": "user", "content": question}],
            "max_tokens": NUM_TOKENS, "temperature": 0, "ignore_eos": True, **fields}
    return httpx.post(stack.base_url + "/v1/chat/completions", json=body, timeout=120)


def read_metrics(stack) -> dict[str, float]:
    with urllib.request.urlopen(stack.base_url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("natsllm:spec_decode")}


def test_tp2_greedy_with_speculation_equals_tp1_without(stack, model_path, reference):
    for q in QUESTIONS:
        resp = chat(stack, model_path, q, logprobs=True)
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        assert [item["bytes"] for item in choice["logprobs"]["content"]] == reference[q]
    metrics = read_metrics(stack)
    assert metrics['natsllm:spec_decode_num_drafts_total{model_name="' + os.path.basename(model_path) + '"}'] > 0
    assert sum(v for k, v in metrics.items() if k.startswith("natsllm:spec_decode_num_accepted_tokens_total")) > 0
    per_pos = [v for k, v in metrics.items() if "per_pos" in k and 'position="0"' in k]
    assert per_pos and per_pos[0] > 0


def stream_choices(resp) -> list[dict]:
    """The choices of each SSE event of a streamed response, in order."""
    assert resp.status_code == 200, resp.text
    events = [json.loads(line[6:]) for line in resp.text.splitlines() if line.startswith("data: {")]
    return [event["choices"][0] for event in events if event["choices"]]


def test_a_stream_carries_every_token_once_and_in_order(stack, model_path, reference):
    q = QUESTIONS[3]
    choices = stream_choices(chat(stack, model_path, q, stream=True, logprobs=True))
    tokens = [item["bytes"] for c in choices for item in (c.get("logprobs") or {}).get("content") or []]
    assert tokens == reference[q]
    text = "".join(c["delta"].get("content") or "" for c in choices)
    assert text == chat(stack, model_path, q).json()["choices"][0]["message"]["content"]


def test_a_stop_string_inside_an_accepted_run_cuts_exactly_there(stack, model_path):
    for q in QUESTIONS:
        text = chat(stack, model_path, q).json()["choices"][0]["message"]["content"]
        middle = len(text) // 2
        stop = next((text[i : i + 2] for i in range(middle, len(text) - 2) if text[i : i + 2].isalnum()), None)
        if stop is not None:
            break
    cut = text[: text.index(stop)]
    for stream in (False, True):
        resp = chat(stack, model_path, q, stop=[stop], stream=stream)
        if stream:
            choices = stream_choices(resp)
            got, reason = "".join(c["delta"].get("content") or "" for c in choices), choices[-1]["finish_reason"]
        else:
            assert resp.status_code == 200, resp.text
            got, reason = resp.json()["choices"][0]["message"]["content"], resp.json()["choices"][0]["finish_reason"]
        assert (got, reason) == (cut, "stop")


def test_max_tokens_is_never_exceeded(stack, model_path):
    for max_tokens in (1, 2, 5):
        resp = chat(stack, model_path, QUESTIONS[3], max_tokens=max_tokens)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == max_tokens
