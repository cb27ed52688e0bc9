"""The detokenizer service on a real nats-server: per-gateway delta batches, stop aborts."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import nats
import pytest

from services.detokenizer.service import THREAD_MIN_TOKENS, DetokenizerService
from shared.protocol import (
    ABORT_REQUEST,
    DETOKENIZE,
    ENGINE_OUTPUT_BATCH,
    PONG,
    STREAM_DELTA_BATCH,
    EngineOutput,
    EngineOutputBatch,
    FinishReason,
    Logprobs,
    engine_abort_subject,
    gateway_stream_subject,
    ping_subject,
)
from shared.token_window import window_tokens

ROOT = Path(__file__).resolve().parents[2]


class Collector:
    """Subscribes to the gateways' subjects and the abort subject, records what arrives."""

    def __init__(self) -> None:
        self.deltas: dict[str, list] = {}
        self.aborts: list[str] = []
        self.abort_subjects: set[str] = set()

    async def subscribe(self, nc, gateway_ids):
        for gateway_id in gateway_ids:
            self.deltas[gateway_id] = []

            async def on_deltas(msg, gateway_id=gateway_id):
                self.deltas[gateway_id].extend(STREAM_DELTA_BATCH.decode(msg.data).deltas)

            await nc.subscribe(gateway_stream_subject(gateway_id), cb=on_deltas)

        async def on_abort(msg):
            self.abort_subjects.add(msg.subject)
            self.aborts.extend(ABORT_REQUEST.decode(msg.data).request_ids)

        await nc.subscribe(engine_abort_subject("*"), cb=on_abort)
        await nc.flush()


async def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def step_outputs(requests, n, num_new, finish_at=None):
    """One step's EngineOutputs after ``n`` output tokens of every request."""
    outputs = []
    for request_id, (gateway_id, out, stop) in requests.items():
        if n > len(out):
            continue
        start = max(0, n - num_new - window_tokens(stop))
        finish = FinishReason.LENGTH if n == len(out) else FinishReason.NONE
        outputs.append(EngineOutput(
            request_id=request_id, gateway_id=gateway_id, new_token_ids=out[n - num_new:n],
            window_token_ids=out[start:n], window_offset=start, num_prompt_tokens=11,
            finish_reason=finish, stop=stop, num_cached_tokens=4,
        ))
    return outputs


@pytest.fixture(scope="module")
async def detokenizer(nats_server, smollm_tokenizer):
    service = DetokenizerService(smollm_tokenizer, nats_url=nats_server.url)
    await service.start()
    yield service
    await service.close()


@pytest.fixture
async def nc(nats_server):
    client = await nats.connect(nats_server.url)
    yield client
    await client.close()


async def test_deltas_go_to_their_own_gateway_with_offsets(detokenizer, nc, smollm_tokenizer):
    encode = lambda text: smollm_tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    requests = {
        "a1": ("gw-a", encode("Hello 😀 world, 你好!"), []),
        "a2": ("gw-a", encode("Second one on A.") + [smollm_tokenizer.eos_token_id], []),
        "b1": ("gw-b", encode("Bravo: Ελληνικά ✓ and more"), ["\n\n"]),
    }
    collector = Collector()
    await collector.subscribe(nc, ["gw-a", "gw-b"])
    longest = max(len(out) for _, out, _ in requests.values())
    for n in range(1, longest + 1):
        await nc.publish(DETOKENIZE, ENGINE_OUTPUT_BATCH.encode(EngineOutputBatch(step_outputs(requests, n, 1))))
    await wait_for(lambda: sum(map(len, collector.deltas.values())) == sum(len(o) for _, o, _ in requests.values()))

    for gateway_id, deltas in collector.deltas.items():
        mine = {r for r, (g, _, _) in requests.items() if g == gateway_id}
        assert {d.request_id for d in deltas} == mine
    for request_id, (gateway_id, out, _) in requests.items():
        deltas = sorted((d for d in collector.deltas[gateway_id] if d.request_id == request_id),
                        key=lambda d: d.token_offset)
        assert [d.token_offset for d in deltas] == list(range(len(out)))
        assert all(d.num_tokens == 1 and d.num_prompt_tokens == 11 and d.num_cached_tokens == 4 for d in deltas)
        assert "".join(d.text for d in deltas) == smollm_tokenizer.decode(out)
        assert [d.finish_reason for d in deltas] == [FinishReason.NONE] * (len(out) - 1) + [FinishReason.LENGTH]
    assert collector.aborts == []


async def test_stop_string_ends_the_stream_and_aborts(detokenizer, nc, smollm_tokenizer):
    out = smollm_tokenizer.encode("alpha beta STOP gamma delta epsilon", add_special_tokens=False)
    requests = {"s1": ("gw-s", out, ["STOP"]), "s2": ("gw-s", out, [])}
    collector = Collector()
    await collector.subscribe(nc, ["gw-s"])
    eos = smollm_tokenizer.eos_token_id
    for n in range(1, len(out) + 1):
        outputs = step_outputs(requests, n, 1)
        outputs[0].logprobs = [Logprobs([out[n - 1], eos], [-0.25, -3.0], 1)]
        await nc.publish(DETOKENIZE, ENGINE_OUTPUT_BATCH.encode(EngineOutputBatch(outputs)))
    await wait_for(lambda: any(d.request_id == "s2" and d.finish_reason for d in collector.deltas["gw-s"]))
    await wait_for(lambda: "s1" in collector.aborts)

    s1 = sorted((d for d in collector.deltas["gw-s"] if d.request_id == "s1"), key=lambda d: d.token_offset)
    assert "".join(d.text for d in s1) == "alpha beta "
    assert s1[-1].finish_reason == FinishReason.STOP
    assert all(d.finish_reason == FinishReason.NONE for d in s1[:-1])
    # Outputs made after the stop (before the abort reached the scheduler) are dropped.
    assert s1[-1].token_offset < len(out) - 1
    assert [d.token_offset for d in s1] == list(range(len(s1)))
    assert s1[0].logprobs[0].token == smollm_tokenizer.decode([out[0]])
    assert s1[0].logprobs[0].top_logprobs[0].token == "<|im_end|>"
    s2 = [d for d in collector.deltas["gw-s"] if d.request_id == "s2"]
    assert "".join(d.text for d in sorted(s2, key=lambda d: d.token_offset)) == smollm_tokenizer.decode(out)
    assert "s2" not in collector.aborts
    # On the owning gateway's abort subject: schedulers obey it only for that gateway's requests.
    assert collector.abort_subjects == {engine_abort_subject("gw-s")}


async def test_error_outputs_pass_through(detokenizer, nc):
    collector = Collector()
    await collector.subscribe(nc, ["gw-e"])
    output = EngineOutput(request_id="e1", gateway_id="gw-e", new_token_ids=[], window_token_ids=[],
                          window_offset=7, num_prompt_tokens=3, finish_reason=FinishReason.ERROR,
                          error="engine 0 failed: worker rank 0 restarted")
    await nc.publish(DETOKENIZE, ENGINE_OUTPUT_BATCH.encode(EngineOutputBatch([output])))
    await wait_for(lambda: collector.deltas["gw-e"])
    [delta] = collector.deltas["gw-e"]
    assert (delta.token_offset, delta.num_tokens, delta.text) == (7, 0, "")
    assert delta.finish_reason == FinishReason.ERROR and delta.error.startswith("engine 0 failed")


async def test_command_line_service_serves_the_queue_group(detokenizer, nats_server, nc, smollm_tokenizer, smollm_path):
    """``python -m services.detokenizer`` starts, answers pings and turns tokens into text."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NATS_URL": nats_server.url, "MODEL": smollm_path}
    process = subprocess.Popen([sys.executable, "-m", "services.detokenizer"], cwd=ROOT, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 40
        while True:
            assert process.poll() is None, process.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the detokenizer did not come up"
            pong = PONG.decode((await nc.request(ping_subject("detokenizer"), b"", timeout=1)).data)
            if pong.instance_id != detokenizer.instance_id:  # the queue group picks either replica
                break
            await asyncio.sleep(0.05)
        # Both replicas share the subject: some batches reach each.
        before = detokenizer.num_outputs
        collector = Collector()
        await collector.subscribe(nc, ["gw-cli"])
        out = smollm_tokenizer.encode("ok 👍", add_special_tokens=False)
        for i in range(40):
            output = EngineOutput(request_id=f"c{i}", gateway_id="gw-cli", new_token_ids=out, window_token_ids=out,
                                  window_offset=0, num_prompt_tokens=1, finish_reason=FinishReason.LENGTH)
            await nc.publish(DETOKENIZE, ENGINE_OUTPUT_BATCH.encode(EngineOutputBatch([output])))
        await wait_for(lambda: len(collector.deltas["gw-cli"]) == 40)
        assert {d.text for d in collector.deltas["gw-cli"]} == {"ok 👍"}
        assert 0 < detokenizer.num_outputs - before < 40
    finally:
        process.terminate()
        process.wait(10)


async def test_a_bad_output_fails_only_its_request(detokenizer, nc, smollm_tokenizer):
    collector = Collector()
    await collector.subscribe(nc, ["gw-x"])
    out = smollm_tokenizer.encode("fine text", add_special_tokens=False)
    good = EngineOutput(request_id="x-good", gateway_id="gw-x", new_token_ids=out, window_token_ids=out,
                        window_offset=0, num_prompt_tokens=1)
    bad = EngineOutput(request_id="x-bad", gateway_id="gw-x", new_token_ids=[1, 2, 3], window_token_ids=[3],
                       window_offset=4, num_prompt_tokens=1)
    await nc.publish(DETOKENIZE, ENGINE_OUTPUT_BATCH.encode(EngineOutputBatch([bad, good])))
    await wait_for(lambda: len(collector.deltas["gw-x"]) == 2 and collector.aborts)
    deltas = {d.request_id: d for d in collector.deltas["gw-x"]}
    assert deltas["x-good"].text == "fine text" and deltas["x-good"].finish_reason == FinishReason.NONE
    assert deltas["x-bad"].finish_reason == FinishReason.ERROR and "detokenizing failed" in deltas["x-bad"].error
    assert collector.aborts == ["x-bad"]


async def test_a_big_batch_is_decoded_off_the_event_loop(detokenizer, nc, smollm_tokenizer):
    collector = Collector()
    await collector.subscribe(nc, ["gw-big"])
    words = [f" word{i} 😀" for i in range(400)]
    outputs = []
    for i, word in enumerate(words):
        out = smollm_tokenizer.encode("Some text" + word, add_special_tokens=False)
        outputs.append(EngineOutput(request_id=f"big{i}", gateway_id="gw-big", new_token_ids=out[-3:],
                                    window_token_ids=out, window_offset=0, num_prompt_tokens=1,
                                    finish_reason=FinishReason.LENGTH))
    assert sum(len(o.window_token_ids) for o in outputs) > THREAD_MIN_TOKENS
    await nc.publish(DETOKENIZE, ENGINE_OUTPUT_BATCH.encode(EngineOutputBatch(outputs)))
    await wait_for(lambda: len(collector.deltas["gw-big"]) == len(outputs))
    for output, delta in zip(outputs, sorted(collector.deltas["gw-big"], key=lambda d: int(d.request_id[3:]))):
        full = smollm_tokenizer.decode(output.window_token_ids)
        assert full.startswith(smollm_tokenizer.decode(output.window_token_ids[:-3]))
        assert delta.text == full[len(smollm_tokenizer.decode(output.window_token_ids[:-3])):]
        assert delta.token_offset == len(output.window_token_ids) - 3 and delta.num_tokens == 3
