"""The tokenizer service on a real nats-server, with a fake scheduler on ``llm.engine.requests``."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

from types import SimpleNamespace

import msgspec
import nats
import pytest

from services.tokenizer.config import TokenizerConfig
from services.tokenizer.service import NO_SCHEDULER, TokenizerService
from shared.bus import flush_in_order
from shared.protocol import (
    ENGINE_REQUEST,
    ENGINE_REQUEST_REPLY,
    ENGINE_REQUESTS,
    PONG,
    TOKENIZE,
    TOKENIZE_REPLY,
    TOKENIZE_REQUEST,
    EngineRequestReply,
    ErrorInfo,
    SamplingParams,
    TokenizeRequest,
    ping_subject,
)

ROOT = Path(__file__).resolve().parents[2]
MAX_MODEL_LEN = 128
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2? 😀"},
]
KV_FULL = ErrorInfo("the prompt does not fit the KV cache", param="messages")


class FakeScheduler:
    """Takes EngineRequests like the scheduler: records them and answers; ids starting
    with "reject" are refused, "hold" ones are answered only when released."""

    def __init__(self) -> None:
        self.requests = {}
        self.held: list = []
        self.sub = None

    async def start(self, nc) -> "FakeScheduler":
        async def on_request(msg):
            request = ENGINE_REQUEST.decode(msg.data)
            self.requests[request.request_id] = request
            if request.request_id.startswith("hold"):
                self.held.append(msg)
                return
            error = KV_FULL if request.request_id.startswith("reject") else None
            reply = EngineRequestReply(request.request_id, error, engine_id="e0", incarnation="inc-1")
            await msg.respond(ENGINE_REQUEST_REPLY.encode(reply))

        self.sub = await nc.subscribe(ENGINE_REQUESTS, queue="scheduler", cb=on_request)
        await flush_in_order(nc)
        return self

    async def release(self) -> None:
        for msg in self.held:
            request = ENGINE_REQUEST.decode(msg.data)
            await msg.respond(ENGINE_REQUEST_REPLY.encode(EngineRequestReply(request.request_id)))
        self.held.clear()


@pytest.fixture(scope="module")
async def tokenizer_service(nats_server, smollm_tokenizer):
    service = TokenizerService(smollm_tokenizer, max_model_len=MAX_MODEL_LEN, vocab_size=smollm_tokenizer.vocab_size,
                               extra_eos_token_ids=[smollm_tokenizer.eos_token_id],
                               config=TokenizerConfig(scheduler_timeout=1.0, structured_outputs_warmup=False),
                               nats_url=nats_server.url)
    await service.start()
    yield service
    await service.close()


@pytest.fixture
async def nc(nats_server):
    client = await nats.connect(nats_server.url)
    yield client
    await client.close()


@pytest.fixture
async def scheduler(nc):
    fake = await FakeScheduler().start(nc)
    yield fake
    await fake.sub.unsubscribe()


async def tokenize(nc, request_id="r", timeout=10.0, n=1, **fields):
    """Ask for one prompt with ``n`` samples: ``request_id`` (n=1) or ``request_id-i``, or
    the samples' ids when ``request_id`` is a list."""
    if isinstance(request_id, list):
        request_ids = request_id
    else:
        request_ids = [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]
    request = TokenizeRequest(request_ids=request_ids, gateway_id="gw-1", **fields)
    msg = await nc.request(TOKENIZE, TOKENIZE_REQUEST.encode(request), timeout=timeout)
    return TOKENIZE_REPLY.decode(msg.data)


async def test_chat_request_reaches_the_scheduler_tokenized(tokenizer_service, nc, scheduler, smollm_tokenizer):
    before = time.time()
    reply = await tokenize(nc, "chat-1", messages=MESSAGES, cache_salt="salt",
                           sampling_params=SamplingParams(temperature=0.5, top_k=-1, max_tokens=0, stop=["\n"]))
    expected = smollm_tokenizer.encode(smollm_tokenizer.apply_chat_template(MESSAGES), add_special_tokens=False)
    assert reply.error is None and reply.num_prompt_tokens == len(expected)
    # The gateway learns which engine (and scheduler incarnation) holds the request.
    [choice] = reply.choices
    assert (choice.request_id, choice.error, choice.engine_id, choice.incarnation) == ("chat-1", None, "e0", "inc-1")
    request = scheduler.requests["chat-1"]
    assert request.prompt_token_ids == expected
    assert request.eos_token_id == smollm_tokenizer.eos_token_id
    assert (request.gateway_id, request.cache_salt) == ("gw-1", "salt")
    assert request.sampling_params == SamplingParams(temperature=0.5, top_k=0, max_tokens=MAX_MODEL_LEN - len(expected),
                                                     stop=["\n"])
    assert before <= request.arrival_time <= time.time()


def test_the_models_other_eos_ids_become_stop_token_ids(smollm_tokenizer):
    eos = smollm_tokenizer.eos_token_id
    service = TokenizerService(smollm_tokenizer, MAX_MODEL_LEN, smollm_tokenizer.vocab_size, extra_eos_token_ids=[eos, 7])
    request = TokenizeRequest(request_ids=["e"], gateway_id="g", prompt="hi",
                              sampling_params=SamplingParams(stop_token_ids=[9]))
    [prepared] = service.preparer.prepare(request, smollm_tokenizer)
    assert prepared.eos_token_id == eos and prepared.sampling_params.stop_token_ids == [9, 7]
    ignoring = msgspec.structs.replace(request, sampling_params=SamplingParams(ignore_eos=True))
    assert service.preparer.prepare(ignoring, smollm_tokenizer)[0].sampling_params.stop_token_ids == []


async def test_prompt_and_token_id_requests(tokenizer_service, nc, scheduler, smollm_tokenizer):
    reply = await tokenize(nc, "text-1", prompt="Once upon a time", sampling_params=SamplingParams(max_tokens=5))
    assert reply.error is None
    assert scheduler.requests["text-1"].prompt_token_ids == smollm_tokenizer.encode("Once upon a time")
    assert scheduler.requests["text-1"].sampling_params.max_tokens == 5
    reply = await tokenize(nc, "ids-1", prompt_token_ids=[5, 6, 7])
    assert reply.error is None and reply.num_prompt_tokens == 3
    assert scheduler.requests["ids-1"].prompt_token_ids == [5, 6, 7]


@pytest.mark.parametrize("fields, param", [
    (dict(messages=MESSAGES, sampling_params=SamplingParams(temperature=3.0)), "temperature"),
    (dict(messages=MESSAGES, sampling_params=SamplingParams(top_p=0.0)), "top_p"),
    (dict(messages=MESSAGES, sampling_params=SamplingParams(top_k=-5)), "top_k"),
    (dict(messages=MESSAGES, sampling_params=SamplingParams(min_p=2.0)), "min_p"),
    (dict(messages=MESSAGES, sampling_params=SamplingParams(presence_penalty=-3.0)), "presence_penalty"),
    (dict(messages=MESSAGES, sampling_params=SamplingParams(frequency_penalty=3.0)), "frequency_penalty"),
    (dict(messages=MESSAGES, sampling_params=SamplingParams(repetition_penalty=-1.0)), "repetition_penalty"),
    (dict(messages=MESSAGES, sampling_params=SamplingParams(max_tokens=-2)), "max_tokens"),
    (dict(messages=MESSAGES, sampling_params=SamplingParams(min_tokens=9, max_tokens=8)), "min_tokens"),
    (dict(messages=MESSAGES, sampling_params=SamplingParams(logprobs=21)), "logprobs"),
    (dict(messages=MESSAGES, sampling_params=SamplingParams(stop=[""])), "stop"),
    (dict(messages=MESSAGES, sampling_params=SamplingParams(stop_token_ids=[10**6])), "stop_token_ids"),
    (dict(messages=[]), "messages"),
    (dict(messages=[{"role": "wizard", "content": "x"}]), "messages"),
    (dict(messages=[{"role": "user", "content": {"a": 1}}]), "messages"),
    (dict(messages=MESSAGES, prompt="x"), "prompt"),
    (dict(), "messages"),
    (dict(prompt_token_ids=[49152]), "prompt_token_ids"),
    (dict(prompt=""), "prompt"),
    (dict(prompt_token_ids=[]), "prompt_token_ids"),
    (dict(prompt="word " * 200), "prompt"),
    (dict(prompt="Hello", sampling_params=SamplingParams(max_tokens=MAX_MODEL_LEN)), "max_tokens"),
])
async def test_invalid_requests_get_400_naming_the_param(tokenizer_service, nc, scheduler, fields, param):
    reply = await tokenize(nc, "bad", **fields)
    assert reply.error is not None and reply.error.status == 400, reply
    assert reply.error.param == param and reply.error.type == "invalid_request_error"
    assert "bad" not in scheduler.requests


async def test_context_length_message(tokenizer_service, nc, scheduler, smollm_tokenizer):
    reply = await tokenize(nc, "long", prompt="Hello", sampling_params=SamplingParams(max_tokens=MAX_MODEL_LEN))
    n = len(smollm_tokenizer.encode("Hello"))
    assert reply.error.message.startswith(
        f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you requested "
        f"{n + MAX_MODEL_LEN} tokens ({n} in the prompt, {MAX_MODEL_LEN} in the completion)."
    )
    assert reply.error.code == "context_length_exceeded"


async def test_scheduler_errors_pass_through(tokenizer_service, nc, scheduler):
    reply = await tokenize(nc, "reject-1", messages=MESSAGES)
    assert reply.error is None and reply.choices[0].error == KV_FULL and "reject-1" in scheduler.requests


async def test_n_samples_are_prepared_once_and_answered_each(tokenizer_service, nc, scheduler, monkeypatch):
    prepared = []
    prepare = tokenizer_service.preparer.prepare

    def spy(request, tokenizer=None):
        prepared.append(request.request_ids)
        return prepare(request, tokenizer)

    monkeypatch.setattr(tokenizer_service, "preparer", SimpleNamespace(prepare=spy))
    reply = await tokenize(nc, "three", n=3, messages=MESSAGES, sampling_params=SamplingParams(seed=5))
    assert prepared == [["three-0", "three-1", "three-2"]]
    assert [c.request_id for c in reply.choices] == ["three-0", "three-1", "three-2"]
    assert all(c.error is None and c.engine_id == "e0" for c in reply.choices)
    requests = [scheduler.requests[f"three-{i}"] for i in range(3)]
    assert [r.sampling_params.seed for r in requests] == [5, 6, 7]
    assert len({tuple(r.prompt_token_ids) for r in requests}) == 1
    # A sample the scheduler refuses is reported for that sample only.
    reply = await tokenize(nc, ["mixed-0", "reject-mixed-1"], prompt_token_ids=[5, 6])
    assert reply.error is None and [c.error for c in reply.choices] == [None, KV_FULL]


async def test_no_scheduler_is_a_fast_503(tokenizer_service, nc):
    start = time.monotonic()
    reply = await tokenize(nc, "lonely", messages=MESSAGES)
    assert reply.choices[0].error == ErrorInfo(NO_SCHEDULER, type="service_unavailable", status=503)
    # Answered by nats' no-responders status, not by waiting out the scheduler timeout.
    assert time.monotonic() - start < tokenizer_service.scheduler_timeout


async def test_a_scheduler_that_never_answers_is_a_503(tokenizer_service, nc):
    async def swallow(msg):
        pass

    sub = await nc.subscribe(ENGINE_REQUESTS, queue="scheduler", cb=swallow)
    try:
        reply = await tokenize(nc, "swallowed", messages=MESSAGES)
    finally:
        await sub.unsubscribe()
    [choice] = reply.choices
    assert choice.error.status == 503 and choice.error.type == "service_unavailable"


async def test_a_slow_request_does_not_hold_up_others(tokenizer_service, nc, scheduler):
    slow = asyncio.ensure_future(tokenize(nc, "hold-1", messages=MESSAGES))
    deadline = time.monotonic() + 10
    while "hold-1" not in scheduler.requests:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    fast = await tokenize(nc, "fast-1", prompt="quick")
    assert fast.error is None and fast.choices[0].error is None and not slow.done()
    await scheduler.release()
    assert (await slow).choices[0].error is None


async def test_malformed_request_is_answered_and_the_service_lives_on(tokenizer_service, nc, scheduler):
    msg = await nc.request(TOKENIZE, msgspec.msgpack.encode({"request_id": 5}), timeout=10)
    reply = TOKENIZE_REPLY.decode(msg.data)
    assert reply.error.status == 400 and "malformed" in reply.error.message
    assert (await tokenize(nc, "after", prompt="still here")).error is None


async def test_two_replicas_share_the_queue_group(tokenizer_service, nats_server, nc, scheduler, smollm_path):
    """A second replica, started from the command line, takes part of the requests."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NATS_URL": nats_server.url}
    process = subprocess.Popen(
        [sys.executable, "-m", "services.tokenizer", "--model", smollm_path, "--max-model-len", str(MAX_MODEL_LEN)],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 40
        while True:  # the queue group answers the ping from either replica
            assert process.poll() is None, process.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the second tokenizer did not come up"
            pong = PONG.decode((await nc.request(ping_subject("tokenizer"), b"", timeout=1)).data)
            if pong.instance_id != tokenizer_service.instance_id:
                assert pong.info["max_model_len"] == MAX_MODEL_LEN
                break
            await asyncio.sleep(0.05)
        before = tokenizer_service.num_requests
        replies = await asyncio.gather(*(tokenize(nc, f"rep-{i}", messages=MESSAGES) for i in range(40)))
        assert all(r.error is None and r.choices[0].error is None for r in replies)
        served_here = tokenizer_service.num_requests - before
        assert 0 < served_here < 40
        ids = {tuple(scheduler.requests[f"rep-{i}"].prompt_token_ids) for i in range(40)}
        assert len(ids) == 1  # both replicas tokenize alike
    finally:
        process.terminate()
        process.wait(10)
