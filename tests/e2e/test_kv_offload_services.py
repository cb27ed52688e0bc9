"""The tiered KV cache through the real services: two stacks (each its own nats-server and
processes, the default model) share one disk folder, as two engines of one host would.

Stack A has a host tier and the folder; stack B the folder only, with a small size limit, a
short load timeout and an injected slow load (``NATSLLM_TEST_KV_FAULTS``: the fourth prompt
of a completions request). Documents that do not fit the device pool come back from the
tiers with the same text and ``usage.prompt_tokens_details.cached_tokens`` counting them; a
prompt prefilled on A is a disk hit on B; faults (a slow load, corrupt files, a deleted
folder, the size limit) cost a recompute, never a wrong text or a stopped stack; A's engine
restarted finds a prompt it saw on disk. The deleted folder, the size limit and the restart
are slow-marked (the in-process engine's and the disk tier's tests cover them by default).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path

import httpx
import pytest

from services.launch.nats_server import free_port
from services.launch.stack import StackConfig
from shared.kv_unit_file import unit_files
from tests.e2e.pd_stacks import MODEL
from tests.e2e.stacks import metric, running_stack, wait_until

POOL = ["--num-gpu-blocks", "24", "--max-num-seqs", "8"]
PARAGRAPH = ("The river wound through the valley, past orchards and stone walls, and the people of the town "
             "kept careful records of every flood and harvest. ")
QUESTION = " Question: what did the people keep?"
# ~150 tokens each (9 full blocks): three of them outgrow the 24-block pool.
DOCUMENTS = [f"Record {name}. " + PARAGRAPH * 5 for name in ("north", "south", "east", "west", "hill", "lake")]
BODY = {"model": MODEL, "temperature": 0.0, "max_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kv-tier")


@pytest.fixture(scope="module")
def stack_a(folder, tmp_path_factory):
    config = StackConfig(port=free_port(), log_dir=str(tmp_path_factory.mktemp("kv-a-logs")),
                         args=[*POOL, "--kv-offloading-size", "0.25", "--kv-offloading-path", str(folder)])
    with running_stack(config) as stack:
        yield stack


@pytest.fixture(scope="module")
def stack_b(folder, tmp_path_factory):
    config = StackConfig(port=free_port(), log_dir=str(tmp_path_factory.mktemp("kv-b-logs")),
                         env={"NATSLLM_TEST_KV_FAULTS": "slow_offload=-3-0"},
                         args=[*POOL, "--kv-offloading-path", str(folder), "--kv-offloading-disk-size", "0.05",
                               "--kv-offloading-load-timeout", "1"])
    with running_stack(config) as stack:
        yield stack


def complete(stack, prompt, **fields) -> dict:
    r = httpx.post(stack.base_url + "/v1/completions", json={"prompt": prompt, **BODY, **fields}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def text_and_cached(stack, prompt) -> tuple[str, int]:
    body = complete(stack, prompt)
    return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def files(folder: Path) -> list[Path]:
    """One name per unit file (a file has a name per block: hard links)."""
    return [Path(p) for p in unit_files(folder)]


def names(folder: Path) -> list[Path]:
    """Every name of every unit file: a new unit may take an older one's only name."""
    return sorted(folder.rglob("*.kv"))


def wait_for_files(folder: Path, more_than: int) -> None:
    """Until there are more than ``more_than`` names (``len(names(folder))`` before)."""
    wait_until(lambda: len(names(folder)) > more_than, 30, "no unit files written")
    time.sleep(0.5)  # the last units of the request


def test_documents_that_do_not_fit_come_back_from_the_host_tier_with_the_same_text(stack_a):
    first = [text_and_cached(stack_a, doc + QUESTION) for doc in DOCUMENTS[:3]]
    assert all(cached == 0 for _, cached in first)
    again = [text_and_cached(stack_a, doc + QUESTION) for doc in DOCUMENTS[:3]]
    assert [text for text, _ in again] == [text for text, _ in first]
    body = complete(stack_a, DOCUMENTS[0] + QUESTION)
    prompt_tokens = body["usage"]["prompt_tokens"]
    # Every full block of the prompt but the last (its last token is always computed).
    assert all(cached >= prompt_tokens - 2 * 16 for _, cached in again)
    hits = 'natsllm:kv_offload_tiering_block_hits_total{model_name="%s",tier="CPU"}' % MODEL
    wait_until(lambda: metric(stack_a, hits) > 0, 10, "no host-tier hits in /metrics")  # stats come every second
    loaded = 'natsllm:prompt_tokens_by_source_total{model_name="%s",source="external_kv_transfer"}' % MODEL
    wait_until(lambda: metric(stack_a, loaded) > 0, 10, "no prompt tokens loaded from a tier in /metrics")
    # The bytes come from the worker with the result of a step after the load: a stats
    # message may count the request's hits and loaded tokens before them.
    loaded_bytes = 'natsllm:kv_offload_total_bytes_total{model_name="%s",transfer_type="CPU_to_GPU"}' % MODEL
    wait_until(lambda: metric(stack_a, loaded_bytes) > 0, 10, "no bytes loaded from the host tier in /metrics")

    async def streamed_chat_usage():
        messages = [{"role": "user", "content": DOCUMENTS[1] + QUESTION}]
        body = {"model": MODEL, "messages": messages, "temperature": 0.0, "max_tokens": 4, "stream": True,
                "stream_options": {"include_usage": True}}
        usages = []
        async with httpx.AsyncClient(base_url=stack_a.base_url, timeout=300) as http:
            for _ in range(2):
                async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                    lines = [line async for line in r.aiter_lines() if line.startswith("data: {")]
                usages.append(httpx.Response(200, content=lines[-1][len("data: "):]).json()["usage"])
        return usages

    first_usage, second_usage = asyncio.run(streamed_chat_usage())
    assert second_usage["prompt_tokens_details"]["cached_tokens"] >= second_usage["prompt_tokens"] - 16


def test_a_prompt_prefilled_on_one_engine_is_a_disk_hit_on_another(stack_a, stack_b, folder):
    prompt = DOCUMENTS[3] + QUESTION
    before = len(names(folder))
    text_a, _ = text_and_cached(stack_a, prompt)
    wait_for_files(folder, before)
    hits = 'natsllm:kv_offload_tiering_block_hits_total{model_name="%s",tier="DISK"}' % MODEL
    text_b, cached = text_and_cached(stack_b, prompt)
    assert text_b == text_a and cached >= 128
    wait_until(lambda: metric(stack_b, hits) >= 8, 10, "no disk hits in /metrics")  # stats come every second


def test_a_slow_load_past_its_timeout_is_recomputed_with_the_same_text(stack_b, folder):
    prompt = DOCUMENTS[5] + QUESTION
    before = len(names(folder))
    want, _ = text_and_cached(stack_b, prompt)
    wait_for_files(folder, before)
    for doc in DOCUMENTS[:2]:  # B's device pool forgets the prompt (B has no host tier)
        text_and_cached(stack_b, doc + QUESTION)
    # The fourth prompt's load from disk is held back 3 s; the load timeout is 1 s.
    body = complete(stack_b, ["Hello", "Name a colour.", "Count to three.", prompt])
    assert sorted(body["choices"], key=lambda c: c["index"])[3]["text"] == want
    failures = 'natsllm:kv_offload_load_failures_total{model_name="%s"}' % MODEL
    wait_until(lambda: metric(stack_b, failures) >= 1, 10, "no load failure in /metrics")
    assert text_and_cached(stack_b, "Still serving?")[0]


def test_corrupt_files_are_recomputed_with_the_same_text(stack_a, stack_b, folder):
    prompt = DOCUMENTS[4] + QUESTION
    before = len(names(folder))
    want, _ = text_and_cached(stack_a, prompt)
    wait_for_files(folder, before)
    for path in files(folder):
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(data)
    text, cached = text_and_cached(stack_b, prompt)
    assert text == want and cached < 16
    corrupt = 'natsllm:kv_offload_corrupt_files_total{model_name="%s"}' % MODEL
    wait_until(lambda: metric(stack_b, corrupt) >= 1, 10, "no corrupt file in /metrics")
    assert text_and_cached(stack_b, prompt)[0] == want  # and it keeps serving it


@pytest.mark.slow
def test_a_deleted_folder_costs_a_recompute_and_comes_back(stack_b, folder):
    prompt = DOCUMENTS[5] + QUESTION
    want, _ = text_and_cached(stack_b, prompt)
    deadline = time.monotonic() + 10
    while os.path.exists(folder):  # as `rm -rf` again: the disk thread may be writing a unit into it
        shutil.rmtree(folder, ignore_errors=True)
        assert time.monotonic() < deadline
    assert text_and_cached(stack_b, DOCUMENTS[2] + QUESTION)[0]
    assert text_and_cached(stack_b, prompt)[0] == want
    wait_for_files(folder, 0)  # stores go on into a new folder


@pytest.mark.slow
def test_the_size_limit_keeps_the_folder_small_and_serving_goes_on(stack_b, folder):
    limit = 0.05 * (1 << 30)  # ~18 units of 4 blocks: fewer than these prompts write
    for i in range(8):
        assert text_and_cached(stack_b, f"Page {i}. " + PARAGRAPH * 6 + " Summarise.")[0]
    time.sleep(1)
    unit = max(p.stat().st_size for p in files(folder))
    assert sum(p.stat().st_size for p in files(folder)) <= limit + unit
    assert metric(stack_b, 'natsllm:kv_offload_disk_bytes_used{model_name="%s"}' % MODEL) <= limit + unit


@pytest.mark.slow
def test_a_restarted_engine_finds_a_prompt_it_saw_on_disk(stack_a, folder):
    # A document no other test sent: a test before this one may have deleted the folder with
    # the others' files, which this engine filed less than FILED_SECONDS ago.
    prompt = "Record orchard. " + PARAGRAPH * 5 + " Tell me more about the orchards."
    before = len(names(folder))
    want, _ = text_and_cached(stack_a, prompt)
    wait_for_files(folder, before)
    stack_a.restart_service("worker-0")
    stack_a.restart_service("scheduler")
    stack_a.wait_ready()
    deadline = time.monotonic() + 120
    while True:  # the gateway sees the new engine once its stats say ready
        r = httpx.post(stack_a.base_url + "/v1/completions", json={"prompt": prompt, **BODY}, timeout=300)
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"] == want
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= body["usage"]["prompt_tokens"] - 2 * 16
