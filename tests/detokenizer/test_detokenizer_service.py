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
from shared.bus import flush_in_order
from shared.protocol import (
    ABORT_REQUEST,
    DETOKENIZE,
    DETOKENIZE_STOPS,
    ENGINE_OUTPUT_BATCH,
    PONG,
    STOP_STRINGS,
    STOP_STRINGS_QUERY,
    STREAM_DELTA_BATCH,
    EngineOutput,
    EngineOutputBatch,
    FinishReason,
    Logprobs,
    RequestStopStrings,
    StopStrings,
    engine_abort_subject,
    engine_stops_subject,
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
        await flush_in_order(nc)


async def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def step_outputs(requests, n, num_new, finish_at=None, carried=True):
    """One step's EngineOutputs after ``n`` output tokens of every request; not
    ``carried``: the stop strings are only flagged, as in a scheduler's step outputs."""
    outputs = []
    for request_id, (gateway_id, out, stop) in requests.items():
        if n > len(out):
            continue
        start = max(0, n - num_new - window_tokens(stop))
        finish = FinishReason.LENGTH if n == len(out) else FinishReason.NONE
        outputs.append(EngineOutput(
            request_id=request_id, gateway_id=gateway_id, new_token_ids=out[n - num_new:n],
            window_token_ids=out[start:n], window_offset=start, num_prompt_tokens=11,
            finish_reason=finish, stop=stop if carried else [], num_cached_tokens=4,
            has_stop=bool(stop) and not carried,
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


async def run_stop_stream(nc, request_id, engine_id, out, stop=("STOP",)):
    """Publish ``request_id``'s outputs step by step, stop strings only flagged; its
    deltas in offset order once it ended (and was aborted, when it did not end by length)."""
    gateway_id = f"gw-{request_id}"
    collector = Collector()
    await collector.subscribe(nc, [gateway_id])
    requests = {request_id: (gateway_id, out, list(stop))}
    for n in range(1, len(out) + 1):
        batch = EngineOutputBatch(step_outputs(requests, n, 1, carried=False), engine_id)
        await nc.publish(DETOKENIZE, ENGINE_OUTPUT_BATCH.encode(batch))
    await wait_for(lambda: any(d.finish_reason for d in collector.deltas[gateway_id]))
    await wait_for(lambda: request_id in collector.aborts)
    return sorted(collector.deltas[gateway_id], key=lambda d: d.token_offset)


@pytest.fixture
def stop_text(smollm_tokenizer):
    return smollm_tokenizer.encode("alpha beta STOP gamma delta epsilon zeta eta theta", add_special_tokens=False)


async def test_stop_strings_heard_from_the_broadcast_are_honoured(detokenizer, nc, stop_text):
    update = StopStrings([RequestStopStrings("heard", ["STOP"])])
    await nc.publish(DETOKENIZE_STOPS, STOP_STRINGS.encode(update))
    await nc.publish(DETOKENIZE_STOPS, STOP_STRINGS.encode(update))  # a duplicate changes nothing
    await wait_for(lambda: "heard" in detokenizer.stop_strings)
    queries = detokenizer.num_stop_queries
    deltas = await run_stop_stream(nc, "heard", "e-none", stop_text)
    assert "".join(d.text for d in deltas) == "alpha beta " and deltas[-1].finish_reason == FinishReason.STOP
    assert detokenizer.num_stop_queries == queries  # nothing to ask
    await nc.publish(DETOKENIZE_STOPS, STOP_STRINGS.encode(StopStrings(finished=["heard"])))
    await flush_in_order(nc)
    await wait_for(lambda: detokenizer.stop_strings._forget_at)


async def test_missed_stop_strings_are_asked_of_the_scheduler_once(detokenizer, nc, stop_text):
    asked = []

    async def scheduler(msg):
        request_ids = STOP_STRINGS_QUERY.decode(msg.data).request_ids
        asked.append(request_ids)
        known = [RequestStopStrings(r, ["STOP"]) for r in request_ids if r == "missed"]
        await msg.respond(STOP_STRINGS.encode(StopStrings(known)))

    sub = await nc.subscribe(engine_stops_subject("e-ask"), cb=scheduler)
    await flush_in_order(nc)
    deltas = await run_stop_stream(nc, "missed", "e-ask", stop_text)
    await sub.unsubscribe()
    assert "".join(d.text for d in deltas) == "alpha beta " and deltas[-1].finish_reason == FinishReason.STOP
    assert asked == [["missed"]]  # the answer is cached for the later steps


@pytest.mark.parametrize("scheduler_answers", [False, True])
async def test_unknown_stop_strings_fail_the_request_instead_of_being_ignored(
    detokenizer, nc, stop_text, scheduler_answers
):
    """No answer in time (or a scheduler that does not know the request): an error, and
    the request is aborted; never its text with the stop strings ignored."""
    async def forgetful(msg):
        await msg.respond(STOP_STRINGS.encode(StopStrings()))

    engine_id = f"e-{scheduler_answers}"
    sub = await nc.subscribe(engine_stops_subject(engine_id), cb=forgetful) if scheduler_answers else None
    await flush_in_order(nc)
    timeout, detokenizer.stop_strings_timeout = detokenizer.stop_strings_timeout, 0.3
    try:
        request_id = f"lost-{scheduler_answers}"
        collector = Collector()
        await collector.subscribe(nc, [f"gw-{request_id}"])
        requests = {request_id: (f"gw-{request_id}", stop_text, ["STOP"])}
        batch = EngineOutputBatch(step_outputs(requests, 3, 3, carried=False), engine_id)
        await nc.publish(DETOKENIZE, ENGINE_OUTPUT_BATCH.encode(batch))
        await wait_for(lambda: collector.deltas[f"gw-{request_id}"] and request_id in collector.aborts)
    finally:
        detokenizer.stop_strings_timeout = timeout
        if sub is not None:
            await sub.unsubscribe()
    [delta] = collector.deltas[f"gw-{request_id}"]
    assert delta.finish_reason == FinishReason.ERROR and delta.text == ""
    assert "stop strings" in delta.error and engine_id in delta.error


async def test_an_answer_in_parts_is_asked_for_until_complete(detokenizer, nc, smollm_tokenizer):
    """A scheduler answers as many requests as fit one message; the replica asks for the rest."""
    asked = []

    async def one_at_a_time(msg):
        request_ids = STOP_STRINGS_QUERY.decode(msg.data).request_ids
        asked.append(request_ids)
        await msg.respond(STOP_STRINGS.encode(StopStrings([RequestStopStrings(request_ids[0], ["STOP"])])))

    sub = await nc.subscribe(engine_stops_subject("e-parts"), cb=one_at_a_time)
    await flush_in_order(nc)
    collector = Collector()
    await collector.subscribe(nc, ["gw-parts"])
    out = smollm_tokenizer.encode("one STOP two", add_special_tokens=False)
    requests = {f"part{i}": ("gw-parts", out, ["STOP"]) for i in range(3)}
    batch = EngineOutputBatch(step_outputs(requests, len(out), len(out), carried=False), "e-parts")
    await nc.publish(DETOKENIZE, ENGINE_OUTPUT_BATCH.encode(batch))
    await wait_for(lambda: len(collector.deltas["gw-parts"]) == 3)
    await sub.unsubscribe()
    assert asked == [["part0", "part1", "part2"], ["part1", "part2"], ["part2"]]
    assert {(d.text, d.finish_reason) for d in collector.deltas["gw-parts"]} == {("one ", FinishReason.STOP)}
