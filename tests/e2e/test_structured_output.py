"""Structured output through the whole stack, driven with the official ``openai`` client.

One stack with async scheduling on (as by default) and a KV pool too small for every
request of the concurrent tests at once; and, for one test, a stack without async
scheduling and a smaller pool, where running requests are preempted and recomputed
(under async scheduling the scheduler preempts only when no step is in flight, which
a busy stack rarely allows; the in-process engine's test checks preemption token for
token). Sampled outputs (temperature 1) are checked against their JSON schema with
``jsonschema``, their regex, choice or grammar. ``STRUCTURED_SAMPLES`` sets the samples
per schema (default 5; the acceptance run uses 20).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from pathlib import Path

import jsonschema
import pytest
from openai import AsyncOpenAI, BadRequestError

from tests.e2e.stacks import replicated_config, running_stack
from tests.e2e.test_faults import metric, wait_until

MODEL = "SmolLM2-135M-Instruct"
SAMPLES = int(os.environ.get("STRUCTURED_SAMPLES", "5"))
SEED = 20261126

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "address": {"type": "object",
                        "properties": {"city": {"type": "string", "maxLength": 20},
                                       "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["city", "zip"]},
        },
        "required": ["name", "address"],
    },
    "array": {
        "type": "object",
        "properties": {"colours": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                   "minItems": 2, "maxItems": 4}},
        "required": ["colours"],
    },
    "enum": {
        "type": "object",
        "properties": {"mood": {"enum": ["happy", "sad", "calm"]},
                       "level": {"type": "string", "enum": ["low", "high"]}},
        "required": ["mood", "level"],
    },
    "numbers": {
        "type": "object",
        "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 99},
                       "score": {"type": "integer", "minimum": -5, "maximum": 5},
                       "height": {"type": "number", "minimum": 0, "maximum": 3}},
        "required": ["age", "score", "height"],
    },
    "pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                       "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
                       "ok": {"type": "boolean"}},
        "required": ["code", "email", "ok"],
    },
}
ARITHMETIC = 'root ::= expr\nexpr ::= num (op num){0,3}\nop ::= " + " | " - " | " * "\nnum ::= [1-9] [0-9]?'
ARITHMETIC_RE = r"[1-9][0-9]?( [+*-] [1-9][0-9]?){0,3}"
ISO_DATE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    # 40 blocks of 16 tokens: the concurrent tests need more, so requests wait for blocks.
    # The backend built at start-up, as by default (tests/conftest.py turns that off elsewhere).
    args = ["--max-num-seqs", "32", "--max-num-batched-tokens", "256", "--num-gpu-blocks", "40",
            "--structured-outputs-warmup"]
    with running_stack(replicated_config(tmp_path_factory.mktemp("stack-logs"), args)) as stack:
        yield stack


@pytest.fixture(scope="module")
def client(stack):
    return client_of(stack)


def client_of(stack) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=600)


@pytest.fixture
def preempting_stack(tmp_path_factory):
    args = ["--no-async-scheduling", "--max-num-seqs", "32", "--max-num-batched-tokens", "256",
            "--num-gpu-blocks", "24"]
    with running_stack(replicated_config(tmp_path_factory.mktemp("sync-stack-logs"), args)) as stack:
        yield stack


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def json_schema_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


async def sample_every_schema(client, names=tuple(SCHEMAS)):
    """SAMPLES sampled completions per schema, all at once, each valid. Seeded: the schemas
    allow any whitespace between tokens, and an unseeded draw of this small model now and
    then spends its 200 tokens on it (finish_reason "length", a valid but unfinished object)."""
    async def one(name):
        resp = await client.chat.completions.create(
            model=MODEL, messages=ask(f"Reply with a JSON object ({name})."), temperature=1.0,
            max_tokens=200, n=SAMPLES, seed=SEED, response_format=json_schema_format(name))
        return name, resp

    for name, resp in await asyncio.gather(*(one(name) for name in names)):
        assert len(resp.choices) == SAMPLES
        for choice in resp.choices:
            assert choice.finish_reason == "stop", (name, choice.message.content)
            jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])


def test_the_backend_is_built_at_start_up(stack):
    """--structured-outputs-warmup: every tokenizer replica and the worker build the backend
    before any constrained request (this module's first test; none has been sent)."""
    logs = Path(stack.config.log_dir)
    for name in ("tokenizer-0.log", "tokenizer-1.log", "worker-0.log"):
        wait_until(lambda: "structured-output backend ready (xgrammar" in (logs / name).read_text(), 60,
                   f"{name}: the structured-output backend built at start-up")


async def test_sampled_outputs_follow_their_json_schemas(client):
    await sample_every_schema(client)


async def test_sampled_outputs_follow_their_json_schemas_when_preempted(preempting_stack):
    await sample_every_schema(client_of(preempting_stack), names=("nested", "pattern", "numbers"))
    # Engine stats reach the gateway once a second.
    wait_until(lambda: metric(preempting_stack, "natsllm:num_preemptions_total") > 0, 10, "a preemption")


async def test_streamed_n3_completions_follow_the_schema(client):
    """/v1/completions, streamed, n=3, with vLLM's structured_outputs field."""
    stream = await client.completions.create(
        model=MODEL, prompt="A person as JSON: ", temperature=1.0, max_tokens=200, n=3, stream=True,
        extra_body={"structured_outputs": {"json": SCHEMAS["nested"]}})
    texts, reasons = ["", "", ""], [None, None, None]
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    assert reasons == ["stop"] * 3
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMAS["nested"])


async def test_json_object_regex_choice_and_grammar(client):
    async def chat(question, stream=False, n=3, temperature=1.0, **fields):
        settings = {"model": MODEL, "messages": ask(question), "temperature": temperature, "max_tokens": 120, "n": n}
        if not stream:
            resp = await client.chat.completions.create(**settings, **fields)
            return [(c.message.content, c.finish_reason) for c in resp.choices]
        chunks = await client.chat.completions.create(**settings, stream=True, **fields)
        texts, reasons = [""] * n, [None] * n
        async for chunk in chunks:
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
                reasons[choice.index] = choice.finish_reason or reasons[choice.index]
        return list(zip(texts, reasons))

    results = await asyncio.gather(
        # Any object may be as long as it likes: greedy, so that it surely ends within max_tokens.
        chat('Return a JSON object with one key "colour".', n=1, temperature=0.0, response_format={"type": "json_object"}),
        chat("When was the moon landing?", extra_body={"structured_outputs": {"regex": ISO_DATE}}),
        chat("Is the sky blue?", stream=True, extra_body={"guided_choice": ["yes", "no", "it depends"]}),
        chat("Write a sum.", stream=True, extra_body={"structured_outputs": {"grammar": ARITHMETIC}}),
        chat("An e-mail address?", extra_body={"guided_regex": r"[a-z]{2,8}@[a-z]{2,8}\.(com|org)"}),
    )
    json_objects, dates, choices, sums, emails = results
    for outputs in results:
        assert [reason for _, reason in outputs] == ["stop"] * len(outputs), outputs
    assert all(isinstance(json.loads(text), dict) for text, _ in json_objects)
    assert all(re.fullmatch(ISO_DATE, text) for text, _ in dates)
    assert all(text in ("yes", "no", "it depends") for text, _ in choices)
    assert all(re.fullmatch(ARITHMETIC_RE, text) for text, _ in sums)
    assert all(re.fullmatch(r"[a-z]{2,8}@[a-z]{2,8}\.(com|org)", text) for text, _ in emails)


async def test_greedy_under_an_allowing_grammar_equals_unconstrained(client):
    messages = ask("Name three colours.")
    free = await client.chat.completions.create(model=MODEL, messages=messages, temperature=0.0, max_tokens=24)
    text = free.choices[0].message.content
    constrained = await client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0.0, max_tokens=24,
        extra_body={"guided_regex": re.escape(text) + r"[\s\S]*"})
    assert constrained.choices[0].message.content == text


@pytest.mark.parametrize("fields, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "structured_outputs.json", "invalid JSON schema"),
    ({"extra_body": {"guided_regex": "[0-9"}}, "structured_outputs.regex", "invalid regex"),
    ({"extra_body": {"structured_outputs": {"grammar": "root ::= undefined_rule"}}}, "structured_outputs.grammar",
     "undefined_rule"),
    ({"extra_body": {"guided_regex": "a", "guided_choice": ["b"]}}, "guided_regex", "only one kind"),
])
async def test_invalid_constraints_are_400s_naming_the_problem(client, fields, param, words):
    with pytest.raises(BadRequestError) as info:
        await client.chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=5, **fields)
    error = info.value.body if "message" in (info.value.body or {}) else info.value.body["error"]
    assert info.value.status_code == 400
    assert words in error["message"] and error["param"] == param and error["type"] == "invalid_request_error"


async def test_logit_controls(client, smollm_tokenizer):
    """logit_bias -100 on the greedy first token changes it; allowed_token_ids restricts
    every token; bad words never appear."""
    messages = ask("What is the capital of France?")
    free = await client.chat.completions.create(model=MODEL, messages=messages, temperature=0.0, max_tokens=16,
                                                logprobs=True)
    first = smollm_tokenizer.encode(free.choices[0].logprobs.content[0].token, add_special_tokens=False)
    assert len(first) == 1 and "Paris" in free.choices[0].message.content
    allowed = smollm_tokenizer.encode(" Paris London yes no", add_special_tokens=False)
    biased, restricted, unbad = await asyncio.gather(
        client.chat.completions.create(model=MODEL, messages=messages, temperature=0.0, max_tokens=16,
                                       logit_bias={str(first[0]): -100}),
        client.completions.create(model=MODEL, prompt="The capital of France is", temperature=1.0, max_tokens=12,
                                  extra_body={"allowed_token_ids": allowed, "ignore_eos": True}),
        client.chat.completions.create(model=MODEL, messages=messages, temperature=0.0, max_tokens=16,
                                       extra_body={"bad_words": ["Paris"]}),
    )
    assert biased.choices[0].message.content != free.choices[0].message.content
    assert not biased.choices[0].message.content.startswith(free.choices[0].logprobs.content[0].token)
    text = restricted.choices[0].text
    assert restricted.usage.completion_tokens == 12
    assert smollm_tokenizer.encode(text, add_special_tokens=False) and set(text.split()) <= {"Paris", "London",
                                                                                             "yes", "no"}
    assert "Paris" not in unbad.choices[0].message.content
