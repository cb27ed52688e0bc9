"""The gateway's OpenAI API end to end: the official client against a real gateway on a
real NATS bus, with the fake tokenizer/engine of ``fake_engine.py`` behind it."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from services.gateway.uvicorn_runner import GatewayServer
from shared.protocol import SamplingParams

from .conftest import MODEL, gateway_config, until_engine_ready
from .fake_engine import PROMPT_TOKEN_BASE, WORDS, expected_text, output_tokens


async def test_an_unknown_model_is_404(http, fake):
    """As vLLM: an unknown model (or a LoRA adapter not loaded) is not found."""
    before = len(fake.requests)
    r = await http.post("/v1/chat/completions", json={"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model" and "gpt-4" in error["message"]
    assert len(fake.requests) == before


async def test_models_lists_served_names(client, http):
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL, "test-alias"]
    assert all(m.object == "model" for m in models.data)
    r = await http.get(f"/v1/models/{MODEL}")
    assert r.status_code == 200 and r.json()["id"] == MODEL
    r = await http.get("/v1/models/other")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


async def test_chat_non_stream(client, fake, gateway):
    r = await client.chat.completions.create(
        model="test-alias",
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hello there"}, {"type": "text", "text": "you"}]},
        ],
        temperature=0.5,
        top_p=0.9,
        presence_penalty=0.1,
        frequency_penalty=0.2,
        stop="zzz",
        user="someone",
        extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "min_tokens": 1, "stop_token_ids": [7]},
    )
    assert r.object == "chat.completion"
    assert r.id.startswith("chatcmpl-") and r.model == MODEL
    [choice] = r.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.message.content == expected_text("hello")
    assert choice.finish_reason == "stop" and choice.logprobs is None
    # The fake counts 3 + the last message's words as prompt tokens; one token per word.
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (6, 11, 17)
    assert r.usage.prompt_tokens_details.cached_tokens == 2

    [seen] = [q for q in fake.requests if q.request_id == f"{r.id}-0-0"]
    assert seen.gateway_id == gateway.gateway.gateway_id and seen.model == MODEL
    assert seen.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello there\nyou"},
    ]
    assert seen.sampling_params == SamplingParams(
        temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, presence_penalty=0.1, frequency_penalty=0.2,
        repetition_penalty=1.1, max_tokens=0, min_tokens=1, stop_token_ids=[7], stop=["zzz"],
    )
    assert seen.add_generation_prompt is True


async def test_request_id_names_the_response_and_the_header_wins(http, fake):
    """vLLM's request_id field, or its X-Request-Id header (which wins): the response's id is
    the route's prefix and it; the engine requests keep ids of their own (two clients may
    send the same id)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "request_id": "mine"}
    answers = [await http.post("/v1/chat/completions", json=body) for _ in range(2)]
    assert [r.json()["id"] for r in answers] == ["chatcmpl-mine", "chatcmpl-mine"]
    assert [r.json()["choices"][0]["message"]["content"] for r in answers] == [expected_text("hello")] * 2
    assert fake.requests and not [q for q in fake.requests if "mine" in q.request_id]
    r = await http.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "request_id": "mine"},
                        headers={"X-Request-Id": "from-header"})
    assert r.json()["id"] == "cmpl-from-header"
    chunks = []
    async with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as streamed:
        async for line in streamed.aiter_lines():
            if line.startswith("data: {"):
                chunks.append(line)
    assert chunks and all('"id":"chatcmpl-mine"' in c.replace(" ", "") for c in chunks)
    r = await http.post("/v1/chat/completions", json={**body, "request_id": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_id"


async def test_return_token_ids_in_vllm_shapes(http):
    """vLLM's return_token_ids: chat's prompt_token_ids at the top (the opening chunks when
    streamed) and each choice's token_ids (each chunk's own); a completion choice's both."""
    n_tokens = len(output_tokens("hello"))
    prompt = [PROMPT_TOKEN_BASE + j for j in range(4)]  # the fake's 3 + one word
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "return_token_ids": True, "n": 2}
    body = (await http.post("/v1/chat/completions", json=chat)).json()
    assert body["prompt_token_ids"] == prompt
    assert [c["token_ids"] for c in body["choices"]] == [list(range(n_tokens))] * 2
    plain = (await http.post("/v1/chat/completions", json={**chat, "return_token_ids": False})).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
    chunks = await sse_events(http, "/v1/chat/completions", {**chat, "stream": True})
    openings = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("role")]
    assert len(openings) == 2 and all(c["prompt_token_ids"] == prompt for c in openings)
    for index in (0, 1):
        ids = [t for c in chunks for ch in c["choices"] if ch["index"] == index for t in ch.get("token_ids", [])]
        assert ids == list(range(n_tokens))
    completion = {"model": MODEL, "prompt": ["hello", "world"], "return_token_ids": True, "max_tokens": 50}
    body = (await http.post("/v1/completions", json=completion)).json()
    assert [(c["prompt_token_ids"], c["token_ids"]) for c in body["choices"]] == [(prompt, list(range(n_tokens)))] * 2
    chunks = await sse_events(http, "/v1/completions", {**completion, "stream": True})
    for index in (0, 1):
        mine = [ch for c in chunks for ch in c["choices"] if ch["index"] == index]
        assert mine[0]["prompt_token_ids"] == prompt and all("prompt_token_ids" not in ch for ch in mine[1:])
        assert [t for ch in mine for t in ch["token_ids"]] == list(range(n_tokens))


async def sse_events(http, path: str, body: dict) -> list[dict]:
    events = []
    async with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[len("data: "):]))
    return events


async def test_no_prompt_tokens_details_without_the_flag(nats_server, fake):
    """vLLM's --enable-prompt-tokens-details is on by default here; turned off, usage has no
    prompt_tokens_details (as vLLM without the flag), streamed or not."""
    async with GatewayServer(gateway_config(enable_prompt_tokens_details=False), nats_url=nats_server.url) as server:
        await until_engine_ready(server)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=10) as http:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}
            whole = await http.post("/v1/chat/completions", json=body)
            assert whole.status_code == 200, whole.text
            assert whole.json()["usage"]["prompt_tokens"] > 0 and "prompt_tokens_details" not in whole.json()["usage"]
            stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
            async with http.stream("POST", "/v1/chat/completions", json=stream) as r:
                lines = [line async for line in r.aiter_lines() if line.startswith("data: {")]
            assert '"prompt_tokens"' in lines[-1] and "prompt_tokens_details" not in lines[-1]


async def test_the_return_tokens_as_token_ids_flag_is_the_requests_default(nats_server, fake):
    """vLLM's --return-tokens-as-token-ids: a request that does not say otherwise gets it."""
    async with GatewayServer(gateway_config(return_tokens_as_token_ids=True), nats_url=nats_server.url) as server:
        await until_engine_ready(server)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=10) as http:
            for word, field in (("flagdefault", {}), ("flagoff", {"return_tokens_as_token_ids": False})):
                body = {"model": MODEL, "messages": [{"role": "user", "content": word}], **field}
                assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
            [default] = fake.requests_with("flagdefault")
            [off] = fake.requests_with("flagoff")
            assert default.sampling_params.return_tokens_as_token_ids
            assert not off.sampling_params.return_tokens_as_token_ids


async def test_chat_stream_equals_non_stream(client):
    messages = [{"role": "user", "content": "streaming please"}]
    whole = await client.chat.completions.create(model=MODEL, messages=messages)
    stream = await client.chat.completions.create(
        model=MODEL, messages=messages, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert all(c.object == "chat.completion.chunk" and c.model == MODEL for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content == expected_text("streaming")
    # Several content chunks: the deltas were written as they came, in order.
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 5
    *body, last_choice, usage_chunk = chunks
    assert last_choice.choices[0].finish_reason == "stop"
    assert all(c.choices[0].finish_reason is None for c in body)
    assert all(c.usage is None for c in chunks[:-1])
    assert usage_chunk.choices == []
    assert usage_chunk.usage.completion_tokens == len(output_tokens("streaming"))
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage_chunk.usage.prompt_tokens_details.cached_tokens == 2  # streamed usage carries it too


async def test_chat_stream_without_usage(client):
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "plain stream"}], stream=True
    )
    chunks = [chunk async for chunk in stream]
    assert all(c.choices and c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_completions_several_prompts(client, fake):
    r = await client.completions.create(model=MODEL, prompt=["alpha one", "beta two three"])
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [expected_text("alpha"), expected_text("beta")]
    assert [c.finish_reason for c in r.choices] == ["stop", "stop"]
    assert r.usage.prompt_tokens == (2 + 3) + (3 + 3)
    assert r.usage.completion_tokens == 2 * len(output_tokens("alpha"))
    seen = {q.request_id: q for q in fake.requests if q.request_id.startswith(r.id)}
    assert sorted(seen) == [f"{r.id}-0-0", f"{r.id}-1-0"]
    assert seen[f"{r.id}-1-0"].prompt == "beta two three"
    # vLLM's (and OpenAI's) completions default: 16 tokens.
    assert seen[f"{r.id}-0-0"].sampling_params.max_tokens == 16


async def test_completions_token_ids_and_stream(client, fake):
    r = await client.completions.create(model=MODEL, prompt=[[1, 2, 3], [4, 5]], max_tokens=None)
    assert [c.text for c in r.choices] == [expected_text("ids3"), expected_text("ids2")]
    seen = sorted((q for q in fake.requests if q.request_id.startswith(r.id)), key=lambda q: q.request_id)
    assert [q.prompt_token_ids for q in seen] == [[1, 2, 3], [4, 5]]
    assert [q.sampling_params.max_tokens for q in seen] == [0, 0]  # null: as many as fit

    stream = await client.completions.create(
        model=MODEL, prompt=["gamma", "delta"], stream=True, stream_options={"include_usage": True}
    )
    texts = ["", ""]
    finish = [None, None]
    chunks = [c async for c in stream]
    for c in chunks[:-1]:
        [choice] = c.choices
        texts[choice.index] += choice.text
        finish[choice.index] = choice.finish_reason or finish[choice.index]
    assert texts == [expected_text("gamma"), expected_text("delta")]
    assert finish == ["stop", "stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2 * len(output_tokens("gamma"))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 2 * 2  # both prompts' cached tokens


async def test_n_fans_out_with_seed_plus_i(client, fake):
    r = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "sample twice"}], n=2, seed=7
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.message.content for c in r.choices] == [expected_text("sample", 7), expected_text("sample", 8)]
    seen = {q.request_id: q.sampling_params.seed for q in fake.requests if q.request_id.startswith(r.id)}
    assert seen == {f"{r.id}-0-0": 7, f"{r.id}-0-1": 8}
    # One tokenize request for the prompt, carrying both samples (the seed as given).
    [prompt] = [q for q in fake.prompts if q.request_ids[0].startswith(r.id)]
    assert prompt.request_ids == [f"{r.id}-0-0", f"{r.id}-0-1"] and prompt.sampling_params.seed == 7
    assert r.usage.prompt_tokens == 5  # one prompt, counted once
    assert r.usage.completion_tokens == 2 * len(output_tokens("sample", 7))
    again = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "sample twice"}], n=2, seed=7
    )
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]


async def test_n_with_several_prompts_indexes_p_times_n_plus_i(client, fake):
    r = await client.completions.create(model=MODEL, prompt=["first", "second"], n=2, seed=100)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [
        expected_text("first", 100), expected_text("first", 101),
        expected_text("second", 100), expected_text("second", 101),
    ]
    ids = sorted(q.request_id for q in fake.requests if q.request_id.startswith(r.id))
    assert ids == [f"{r.id}-{p}-{i}" for p in range(2) for i in range(2)]
    prompts = sorted(q.request_ids for q in fake.prompts if q.request_ids[0].startswith(r.id))
    assert prompts == [[f"{r.id}-{p}-0", f"{r.id}-{p}-1"] for p in range(2)]

    stream = await client.completions.create(model=MODEL, prompt=["third", "fourth"], n=2, stream=True)
    texts = {}
    async for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {0: expected_text("third"), 1: expected_text("third"),
                     2: expected_text("fourth"), 3: expected_text("fourth")}


async def test_chat_logprobs(client, fake):
    r = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "logprobs please"}], logprobs=True, top_logprobs=2
    )
    [seen] = [q for q in fake.requests if q.request_id.startswith(r.id)]
    assert seen.sampling_params.logprobs == 2
    content = r.choices[0].logprobs.content
    tokens = output_tokens("logprobs")
    assert [lp.token for lp in content] == tokens
    assert [lp.logprob for lp in content] == [-0.25 * (j + 1) for j in range(len(tokens))]
    assert content[1].bytes == list(tokens[1].encode())
    assert [(t.token, t.logprob, t.bytes) for t in content[0].top_logprobs] == [
        ("alt0", -1.0, list(b"alt0")), ("alt1", -2.0, list(b"alt1"))
    ]

    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "logprobs please"}], logprobs=True, stream=True
    )
    streamed = []
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].logprobs:
            streamed.extend(chunk.choices[0].logprobs.content)
    assert [lp.token for lp in streamed] == tokens
    assert all(lp.top_logprobs == [] for lp in streamed)  # logprobs without top_logprobs: 0 alternatives


async def test_completion_logprobs(client, fake):
    r = await client.completions.create(model=MODEL, prompt="offsets here", logprobs=1)
    [seen] = [q for q in fake.requests if q.request_id.startswith(r.id)]
    assert seen.sampling_params.logprobs == 1
    lp = r.choices[0].logprobs
    tokens = output_tokens("offsets")
    assert lp.tokens == tokens
    assert lp.token_logprobs == [-0.25 * (j + 1) for j in range(len(tokens))]
    assert lp.top_logprobs[0] == {"alt0": -1.0, tokens[0]: -0.25}
    assert lp.text_offset == [sum(len(t) for t in tokens[:j]) for j in range(len(tokens))]
    assert "".join(lp.tokens) == r.choices[0].text

    stream = await client.completions.create(model=MODEL, prompt="offsets here", logprobs=1, stream=True)
    offsets, streamed_tokens = [], []
    async for chunk in stream:
        if chunk.choices[0].logprobs:
            offsets += chunk.choices[0].logprobs.text_offset
            streamed_tokens += chunk.choices[0].logprobs.tokens
    assert (streamed_tokens, offsets) == (lp.tokens, lp.text_offset)


async def test_stop_string_and_length_finish_reasons(client):
    r = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "stop early"}], stop=["fox", "never"]
    )
    assert r.choices[0].message.content == "[stop] The quick brown "
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 5  # the stop string's token counts
    r = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "short one"}], max_completion_tokens=3
    )
    assert r.choices[0].message.content == expected_text("short", max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    r = await client.completions.create(model=MODEL, prompt="legacy cap", max_tokens=2)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (expected_text("legacy", max_tokens=2), "length")


async def test_tokenizer_error_passes_through(client, http):
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "REJECT me"}])
    assert info.value.status_code == 400
    r = await http.post("/v1/chat/completions", json={"model": MODEL, "stream": True,
                                                       "messages": [{"role": "user", "content": "REJECT me"}]})
    assert r.status_code == 400
    assert r.json() == {"error": {
        "message": "This model's maximum context length is 64 tokens. However, you requested 100 tokens.",
        "type": "invalid_request_error", "param": "max_tokens", "code": "context_length_exceeded",
    }}


async def test_one_refused_sample_aborts_the_accepted_ones(http, fake, gateway):
    r = await http.post("/v1/chat/completions", json={
        "model": MODEL, "n": 2, "messages": [{"role": "user", "content": "REJECTSECOND HANG"}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    [first] = [q.request_id for q in fake.requests_with("REJECTSECOND") if q.request_id.endswith("-0")]
    await fake.wait_for(lambda: first in fake.aborted)
    assert first[:-1] + "1" not in fake.aborted  # the refused one never reached the engine
    assert first not in gateway.gateway.streams


async def test_engine_error_ends_the_request(http):
    r = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "FAIL now"}]})
    assert r.status_code == 500
    assert r.json()["error"] == {"message": "the engine failed: FAIL", "type": "internal_error",
                                 "param": None, "code": None}
    async with http.stream("POST", "/v1/chat/completions", json={
            "model": MODEL, "stream": True, "messages": [{"role": "user", "content": "FAIL now"}]}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line async for line in r.aiter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert events[-2] == 'data: {"error":{"message":"the engine failed: FAIL","type":"internal_error","param":null,"code":null}}'


@pytest.mark.parametrize(
    "path, body, param, words",
    [
        ("/v1/chat/completions", {"model": MODEL, "messages": []}, "messages", "empty"),
        ("/v1/chat/completions", {"model": MODEL}, "messages", "required"),
        ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, "messages", "list"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "messages", "role"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, "messages", "text parts"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                  "temperature": "hot"}, "temperature", "number"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                  "max_tokens": 0}, "max_tokens", "at least 1"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                  "max_completion_tokens": "5"}, "max_completion_tokens", "integer"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 0}, "n", "at least 1"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                  "top_logprobs": 2}, "top_logprobs", "logprobs"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                  "stream_options": {"include_usage": True}}, "stream_options", "stream"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                  "stop": [1, 2]}, "stop", "strings"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                  "seed": 1.5}, "seed", "integer"),
        ("/v1/completions", {"model": MODEL, "prompt": []}, "prompt", "prompt must be"),
        ("/v1/completions", {"model": MODEL, "prompt": [1, "a"]}, "prompt", "prompt must be"),
        ("/v1/completions", {"model": MODEL}, "prompt", "required"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "echo": True},
         "echo", "not supported"),
        ("/v1/completions", {"model": MODEL, "prompt": [1, 2], "echo": True}, "echo", "text prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": True}, "logprobs", "integer"),
    ],
)
async def test_bad_requests_are_400_naming_the_param(http, fake, path, body, param, words):
    before = len(fake.requests)
    r = await http.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert words in error["message"]
    if param == "model":
        assert error["code"] == "model_not_found"
    assert len(fake.requests) == before  # rejected at the edge or by the tokenizer's checks


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b""])
async def test_malformed_bodies_are_400(http, content):
    r = await http.post("/v1/chat/completions", content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


async def test_unknown_route_and_method_have_openai_error_shape(http):
    r = await http.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = await http.get("/v1/chat/completions")
    assert r.status_code == 405 and "message" in r.json()["error"]


async def test_health_with_a_tokenizer(http, gateway):
    r = await http.get("/health")
    assert r.status_code == 200
    assert r.json()["tokenizer"] is True and r.json()["gateway_id"] == gateway.gateway.gateway_id


async def test_dropped_deltas_for_unknown_requests(gateway):
    # Every fake request publishes a delta for "no-such-request" and a repeat after the end.
    assert gateway.gateway.num_dropped_deltas > 0
    assert gateway.gateway.streams == {}
    assert len(WORDS) == 10
