"""Property-based fuzzing of the HTTP API (hypothesis): whatever a client sends, the
gateway answers without a 5xx, and every 4xx carries OpenAI's error body.

Bodies are drawn around the real request shapes (every field the routes read, with
values of the right and of wrong types, out of range, null, and unknown fields), plus
raw bytes. The fake engine behind the gateway generates instantly; prompt text is
lower-case so it never holds the fake's upper-case control words. ``FUZZ_EXAMPLES``
sets the number of bodies per route (CI: 150; a long run: thousands)."""

from __future__ import annotations

import json
import os

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import MODEL

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

text = st.text(alphabet=st.characters(blacklist_categories=("Lu", "Cs")), max_size=40)
scalar = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False, allow_infinity=False), text)
anything = st.recursive(scalar, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
                        max_leaves=12)
small_int = st.one_of(st.integers(-3, 8), st.integers(-2**64, 2**64), st.none())
number = st.one_of(st.floats(-5, 5, allow_nan=False), st.integers(-3, 3), st.none(), text)
content = st.one_of(text, st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "x"]),
                                                          "text": text}), max_size=3), anything)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "robot", ""]), "content": content},
    optional={"name": text, "tool_calls": anything},
)
common = {
    "model": st.one_of(st.just(MODEL), text, st.none()),
    "max_tokens": small_int, "max_completion_tokens": small_int, "n": st.one_of(st.integers(-1, 3), st.none(), text),
    "temperature": number, "top_p": number, "top_k": small_int, "min_p": number, "seed": small_int,
    "presence_penalty": number, "frequency_penalty": number, "repetition_penalty": number,
    "stop": st.one_of(text, st.lists(text, max_size=5), st.none(), anything),
    "stop_token_ids": st.one_of(st.lists(st.integers(-5, 2**40), max_size=5), anything),
    "stream": st.one_of(st.booleans(), st.none(), text),
    "stream_options": st.one_of(st.none(), st.fixed_dictionaries({"include_usage": st.booleans()}), anything),
    "logprobs": st.one_of(st.booleans(), small_int, st.none()), "top_logprobs": small_int,
    "ignore_eos": st.one_of(st.booleans(), anything), "min_tokens": small_int, "user": st.one_of(text, anything),
    "unknown_field": anything,
    # structured output and logit controls
    "response_format": st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object",
                                                                                 "json_schema", "x"])},
                                                       optional={"json_schema": anything}), anything),
    "structured_outputs": st.one_of(st.dictionaries(st.sampled_from(["json", "regex", "choice", "grammar",
                                                                     "json_object", "backend", "x"]),
                                                    anything, max_size=2), anything),
    "guided_json": anything, "guided_choice": anything,
    "logit_bias": st.one_of(st.dictionaries(st.one_of(text, st.integers(-5, 2**40).map(str)), anything,
                                            max_size=3), anything),
    "allowed_token_ids": st.one_of(st.lists(st.integers(-5, 2**40), max_size=5), anything),
    "bad_words": st.one_of(st.lists(text, max_size=3), anything),
}
chat_body = st.fixed_dictionaries({"messages": st.one_of(st.lists(message, max_size=3), anything)}, optional=common)
completion_body = st.fixed_dictionaries(
    {"prompt": st.one_of(text, st.lists(text, max_size=3), st.lists(st.integers(-5, 60000), max_size=8),
                         st.lists(st.lists(st.integers(0, 60000), max_size=4), max_size=2), anything)},
    optional={**common, "echo": st.booleans(), "suffix": st.one_of(st.none(), text)},
)


def assert_sound(r: httpx.Response, body) -> None:
    assert r.status_code < 500, (r.status_code, r.text, body)
    if r.status_code >= 400:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], r.text
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = [line for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]", r.text
        for event in events[:-1]:
            assert "error" not in json.loads(event[len("data: "):]), r.text
    else:
        assert r.json()["choices"], r.text


@pytest.fixture(scope="module")
def sync_http(gateway):
    with httpx.Client(base_url=gateway.base_url, timeout=30) as client:
        yield client


# hypothesis drives synchronous tests; the module's gateway runs on the session loop,
# so these requests go through a synchronous client in a worker thread.
@pytest.mark.parametrize("route,bodies", [("/v1/chat/completions", chat_body), ("/v1/completions", completion_body)])
async def test_generation_routes_never_answer_5xx(sync_http, route, bodies):
    import asyncio

    @FUZZ
    @given(body=bodies)
    def check(body):
        assert_sound(sync_http.post(route, json=body), body)

    await asyncio.to_thread(check)


async def test_raw_bodies_never_answer_5xx(sync_http):
    import asyncio

    @FUZZ
    @given(raw=st.binary(max_size=200) | anything.map(lambda v: json.dumps(v).encode()))
    def check(raw):
        for route in ("/v1/chat/completions", "/v1/completions"):
            r = sync_http.post(route, content=raw, headers={"content-type": "application/json"})
            assert_sound(r, raw)

    await asyncio.to_thread(check)
