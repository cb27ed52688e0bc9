"""The whole stack over NATS, driven with the official ``openai`` client.

One stack for the module: nats-server, a worker, a scheduler, 2 tokenizers, 2
detokenizers and a gateway, each a real process. Greedy outputs are compared
with Hugging Face transformers on the same chat-templated prompt.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import httpx
import pytest
from openai import AsyncOpenAI, BadRequestError

from tests.e2e.stacks import replicated_config, running_stack

MODEL = "SmolLM2-135M-Instruct"
QUESTIONS = [
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Write one sentence about cats.",
    "How many legs does a spider have?",
    "Give me a synonym for happy.",
    "What is 12 plus 30?",
    "Describe the moon in five words.",
    "Say hello in Spanish.",
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    # The dequantized model: the outputs are compared with transformers' dequantized GGUF.
    args = ["--max-num-seqs", "32", "--max-num-batched-tokens", "512", "--num-gpu-blocks", "512",
            "--quantization", "none"]
    with running_stack(replicated_config(tmp_path_factory.mktemp("stack-logs"), args)) as stack:
        yield stack


@pytest.fixture(scope="module")
def client(stack):
    return AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0)


def messages(question):
    return [{"role": "user", "content": question}]


@pytest.fixture(scope="module")
def greedy_refs(hf_smollm_greedy, smollm_tokenizer):
    """HF greedy text of each question's chat-templated prompt (24 tokens, EOS ignored)."""
    refs = {}
    prompts = [
        smollm_tokenizer.encode(smollm_tokenizer.apply_chat_template(messages(q)), add_special_tokens=False)
        for q in QUESTIONS
    ]
    for q, (tokens, _gaps) in zip(QUESTIONS, hf_smollm_greedy(prompts, 24, stop_at_eos=False)):
        # A character cut by the token limit is never sent half (as in vLLM).
        refs[q] = smollm_tokenizer.decode(tokens).rstrip("\ufffd")
    return refs


GREEDY = {"temperature": 0.0, "max_tokens": 24, "extra_body": {"ignore_eos": True}}


async def test_greedy_chat_equals_hf(client, greedy_refs):
    q = QUESTIONS[0]
    resp = await client.chat.completions.create(model=MODEL, messages=messages(q), **GREEDY)
    assert resp.object == "chat.completion" and resp.model == MODEL
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == greedy_refs[q]
    assert choice.finish_reason == "length"
    assert resp.usage.completion_tokens == 24
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 24


async def test_stream_concatenates_to_the_non_streamed_text_with_usage(client, greedy_refs):
    q = QUESTIONS[1]
    stream = await client.chat.completions.create(
        model=MODEL, messages=messages(q), stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == greedy_refs[q]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert all(c.usage is None for c in chunks[:-1])


async def test_completions_endpoint_stream_and_not(client, smollm_tokenizer, hf_smollm_greedy):
    prompt = "The three primary colours are"
    ids = smollm_tokenizer.encode(prompt)
    want = smollm_tokenizer.decode(hf_smollm_greedy([ids], 16, stop_at_eos=False)[0][0]).rstrip("\ufffd")
    resp = await client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=16,
                                           extra_body={"ignore_eos": True})
    assert resp.choices[0].text == want and resp.object == "text_completion"
    stream = await client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=16,
                                             stream=True, extra_body={"ignore_eos": True})
    assert "".join([c.choices[0].text async for c in stream]) == want


async def test_n2_with_seed_returns_two_reproducible_choices(client):
    kwargs = dict(model=MODEL, messages=messages("Tell me a short story."), n=2, seed=11,
                  temperature=1.0, max_tokens=16)
    first = await client.chat.completions.create(**kwargs)
    second = await client.chat.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1]
    texts = [c.message.content for c in first.choices]
    assert texts == [c.message.content for c in second.choices]
    assert texts[0] != texts[1]


async def test_stop_string_is_cut_stream_and_not(client, greedy_refs):
    q = QUESTIONS[2]
    ref = greedy_refs[q]
    words = ref.split()
    stop = " " + words[len(words) // 2]
    cut = ref[: ref.index(stop)]
    resp = await client.chat.completions.create(model=MODEL, messages=messages(q), stop=[stop], **GREEDY)
    assert resp.choices[0].message.content == cut
    assert resp.choices[0].finish_reason == "stop"
    stream = await client.chat.completions.create(model=MODEL, messages=messages(q), stop=stop,
                                                  stream=True, **GREEDY)
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_max_tokens_gives_length_and_logprobs_have_top_n(client):
    resp = await client.chat.completions.create(
        model=MODEL, messages=messages(QUESTIONS[3]), temperature=0, max_tokens=5,
        logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True},
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "length" and resp.usage.completion_tokens == 5
    content = choice.logprobs.content
    assert len(content) == 5
    assert "".join(t.token for t in content) == choice.message.content
    for item in content:
        assert len(item.top_logprobs) == 3
        assert item.top_logprobs[0].token == item.token  # greedy: the top token
        assert item.logprob <= 0


async def test_32_concurrent_streams_through_replicas(client, greedy_refs):
    async def one(q):
        stream = await client.chat.completions.create(model=MODEL, messages=messages(q), stream=True, **GREEDY)
        return q, "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    results = await asyncio.gather(*(one(QUESTIONS[i % len(QUESTIONS)]) for i in range(32)))
    assert len(results) == 32
    for q, text in results:
        assert text == greedy_refs[q]


def read_metrics(stack) -> dict[str, float]:
    with urllib.request.urlopen(stack.base_url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("natsllm:") and " " in line:
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] = float(value)
    return values


async def wait_idle(stack, deadline_s=20.0):
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        m = read_metrics(stack)
        if m.get("natsllm:kv_cache_usage_perc") == 0 and m.get("natsllm:num_requests_running") == 0:
            return m
        await asyncio.sleep(0.2)
    raise AssertionError(f"engine not idle: {read_metrics(stack)}")


async def test_closing_a_stream_early_frees_its_blocks(stack):
    body = {"model": MODEL, "messages": messages("Count from one to one thousand."), "stream": True,
            "max_tokens": 2000, "ignore_eos": True, "temperature": 0}
    async with httpx.AsyncClient(timeout=30) as http:
        async with http.stream("POST", stack.base_url + "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = 0
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    lines += 1
                if lines >= 5:
                    break
        # Still generating right after the disconnect would show usage > 0; it must drop to 0.
    metrics = await wait_idle(stack)
    assert metrics["natsllm:num_requests_waiting"] == 0


ERROR_CASES = [
    (b"{not json", "malformed JSON"),
    (json.dumps({"model": "no-such-model", "messages": messages("hi")}).encode(), "model"),  # 404, as vLLM
    (json.dumps({"model": MODEL, "messages": []}).encode(), "messages"),
    (json.dumps({"model": MODEL, "messages": messages("hi"), "temperature": -1}).encode(), "temperature"),
    (json.dumps({"model": MODEL, "messages": messages("hi"), "top_p": 0}).encode(), "top_p"),
    (json.dumps({"model": MODEL, "messages": messages("hi"), "max_tokens": 0}).encode(), "max_tokens"),
    (json.dumps({"model": MODEL, "messages": messages("word " * 9000)}).encode(), "context"),
    (json.dumps({"model": MODEL, "messages": "hi"}).encode(), "messages"),
]


@pytest.mark.parametrize("body, what", ERROR_CASES, ids=[w for _, w in ERROR_CASES])
async def test_bad_requests_get_openai_errors_and_the_stack_keeps_serving(stack, client, body, what):
    async with httpx.AsyncClient(timeout=30) as http:
        resp = await http.post(stack.base_url + "/v1/chat/completions", content=body,
                               headers={"Content-Type": "application/json"})
    assert resp.status_code == (404 if what == "model" else 400), resp.text
    error = resp.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert error["message"]
    ok = await client.chat.completions.create(model=MODEL, messages=messages("hi"), max_tokens=2)
    assert ok.choices[0].finish_reason in ("length", "stop")
    assert not stack.dead_services()


async def test_openai_client_raises_bad_request(client):
    with pytest.raises(BadRequestError):
        await client.chat.completions.create(model=MODEL, messages=messages("hi"), max_tokens=-3)


async def test_models_and_health(stack, client):
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    with urllib.request.urlopen(stack.base_url + "/health", timeout=5) as r:
        assert r.status == 200


async def test_no_leak_after_everything(stack):
    metrics = await wait_idle(stack)
    assert metrics["natsllm:prefix_cache_queries_total"] > 0
    assert not stack.dead_services()
