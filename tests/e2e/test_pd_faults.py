"""P/D under injected faults (``shared/kv_transfer_faults.py``, test-only), real services.

Request ids tell the faults which requests they hit: every chunk of a chat request
("chatcmpl-...") is dropped, the release of a completion's second prompt ("...-1-0") is
lost, a completion's third prompt ("...-2-0") transfers slowly, and the decode worker's push
of the end of the load of a prompt's fourth sample ("...-0-3") is lost. Each case ends with
the same text as an undisturbed run (by recomputing the prompt on the decode engine, or,
when the decode scheduler dies, by resuming the requests through a prefill engine), and
with nothing held on either engine.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.pd_stacks import MODEL, engine_stats, kv_idle, pd_config, run_all
from tests.e2e.stacks import running_stack, stream_or_error, wait_until

FAULTS = "drop_chunks=chatcmpl,drop_release=-1-0,slow_chunks=-2-0,drop_load_push=-0-3"
ARGS = ["--kv-chunk-timeout", "1", "--kv-hold-timeout", "6", "--worker-timeout", "3"]
QUESTION = "Tell me about the moon."
BODY = {"model": MODEL, "temperature": 0.0, "max_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def pd_stack(tmp_path_factory):
    config = pd_config(tmp_path_factory.mktemp("pd-fault-logs"), args=ARGS, env={"NATSLLM_TEST_KV_FAULTS": FAULTS})
    with running_stack(config) as stack:
        yield stack


def long_prompt(tokenizer) -> list[int]:
    return tokenizer.encode("The lighthouse keeper wrote down every ship that passed the cape. " * 100)


def decode_stats(stack, seconds: float = 2.5):
    return engine_stats(stack, seconds)["decode-0"]


async def chat_and_completion(stack, prompt_ids):
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as http:
        chat = await stream_or_error(http, "/v1/chat/completions",
                                     {"messages": [{"role": "user", "content": QUESTION}], **BODY})
        plain = await stream_or_error(http, "/v1/completions", {"prompt": prompt_ids, **BODY})
    return chat, plain


def test_dropped_chunks_make_the_decode_engine_recompute_with_the_same_output(pd_stack, smollm_tokenizer):
    before = decode_stats(pd_stack)
    prompt_ids = smollm_tokenizer.encode(
        smollm_tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                             add_generation_prompt=True), add_special_tokens=False)
    chat, plain = asyncio.run(chat_and_completion(pd_stack, prompt_ids))
    assert isinstance(chat, str) and chat == plain  # the chat request's chunks were all dropped
    after = decode_stats(pd_stack)
    assert after.kv_transfer_failures == before.kv_transfer_failures + 1
    assert after.kv_transfer_fallbacks == before.kv_transfer_fallbacks + 1
    wait_until(lambda: kv_idle(pd_stack), 30, "KV blocks left over")


def test_a_lost_push_of_a_loads_end_is_made_up_by_the_schedulers_poll(pd_stack, smollm_tokenizer):
    prompt = smollm_tokenizer.encode("Name a mountain.")
    want = run_all(pd_stack, [prompt])[0]
    before = decode_stats(pd_stack)

    async def four_samples():
        async with httpx.AsyncClient(base_url=pd_stack.base_url, timeout=120) as http:
            r = await http.post("/v1/completions", json={"prompt": prompt, "n": 4, **BODY})
            return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]

    assert asyncio.run(four_samples()) == [want] * 4  # sample 3's push was lost
    after = decode_stats(pd_stack)
    assert after.kv_transfer_requests >= before.kv_transfer_requests + 4
    assert after.kv_transfer_fallbacks == before.kv_transfer_fallbacks  # loaded, not recomputed at the deadline
    wait_until(lambda: kv_idle(pd_stack), 30, "KV blocks left over")


def test_a_lost_release_frees_the_prefill_blocks_at_the_hold_timeout(pd_stack, smollm_tokenizer):
    prompts = [smollm_tokenizer.encode("Name a fruit."), smollm_tokenizer.encode("Name a river in Europe.")]
    want = run_all(pd_stack, prompts)  # each prompt its own request (ids "...-0-0"): no fault

    async def both():
        async with httpx.AsyncClient(base_url=pd_stack.base_url, timeout=120) as http:
            r = await http.post("/v1/completions", json={"prompt": prompts, **BODY})
            return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]

    assert asyncio.run(both()) == want
    log = Path(pd_stack.config.log_dir) / "prefill-0-scheduler.log"
    wait_until(lambda: "-1-0: no release within 6s" in log.read_text(), 30, "the held blocks were not timed out")
    wait_until(lambda: kv_idle(pd_stack), 30, "KV blocks left over")


def test_killing_the_prefill_worker_mid_transfer_costs_a_recompute(pd_stack, smollm_tokenizer):
    prompts = [smollm_tokenizer.encode("Name a planet."), smollm_tokenizer.encode("Name a bird."),
               long_prompt(smollm_tokenizer)]
    before = decode_stats(pd_stack)

    async def run_and_kill():
        async with httpx.AsyncClient(base_url=pd_stack.base_url, timeout=180) as http:
            task = asyncio.ensure_future(
                http.post("/v1/completions", json={"prompt": prompts, **BODY}))
            deadline = time.monotonic() + 60
            while not (await asyncio.to_thread(decode_stats, pd_stack, 1.2)).num_requests_waiting_for_remote_kv:
                assert time.monotonic() < deadline, "the slow transfer never started"
            pd_stack.supervisor.kill("prefill-0-worker-0")  # SIGKILL, in the middle of the slow transfer
            r = await task
            return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]

    # First seen now: neither engine has the long prompt in its prefix cache, every block moves.
    texts = asyncio.run(run_and_kill())
    assert decode_stats(pd_stack).kv_transfer_fallbacks >= before.kv_transfer_fallbacks + 1
    wait_until(lambda: engine_stats(pd_stack)["prefill-0"].ready, 180, "the prefill engine did not come back")
    assert texts == run_all(pd_stack, prompts)  # as undisturbed requests (each its own: no slow transfer)
    wait_until(lambda: kv_idle(pd_stack), 30, "KV blocks left over")


def test_killing_the_decode_scheduler_costs_no_text(pd_stack, smollm_tokenizer):
    """The decode engine holds every stream when its scheduler dies: the gateway sees the
    restarted (or silent) decode engine and sends each request again with the tokens its
    client has; a prefill engine recomputes them and hands them off again (or decodes them
    itself), and every stream ends with the text of an undisturbed run."""
    prompts = [smollm_tokenizer.encode(q) for q in ("Write a long story.", "Describe a city.", "List animals.")]
    max_tokens = 40

    async def run_and_kill():
        started = [asyncio.Event() for _ in prompts]
        body = {**BODY, "max_tokens": max_tokens}
        async with httpx.AsyncClient(base_url=pd_stack.base_url, timeout=180) as http:
            tasks = [asyncio.ensure_future(stream_or_error(http, "/v1/completions", {"prompt": p, **body}, e))
                     for p, e in zip(prompts, started)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
            await asyncio.sleep(1.0)  # every stream's first token is out: the decode engine holds them
            pd_stack.supervisor.kill("decode-0-scheduler")
            return await asyncio.gather(*tasks)

    texts = asyncio.run(run_and_kill())
    assert texts == run_all(pd_stack, prompts, max_tokens=max_tokens)
    wait_until(lambda: kv_idle(pd_stack), 120, "not idle again after the decode scheduler's restart")
