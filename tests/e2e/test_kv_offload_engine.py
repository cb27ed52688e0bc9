"""The tiered KV cache in the in-process engine (both connector roles, real copies): greedy
tokens are the same with the tiers on or off, with swap or recompute, from a fresh engine
that finds the blocks on disk (a restart), and when a unit file is corrupt; round 2 of
documents that do not fit the device pool loads them from a tier.

The default suite runs a tiny random Llama (40-block pool, token-id documents of 15 blocks
each, three of them); the slow one the default model too (48-block pool, 17-block documents).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from services.engine import Engine
from shared.config import CacheConfig, KVOffloadConfig, SchedulerConfig
from shared.kv_unit_file import unit_files
from shared.protocol import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module", params=["tiny", pytest.param("smollm", marks=pytest.mark.slow)])
def model(request):
    """(worker, three documents that together outgrow its pool, one question per round)."""
    if request.param == "tiny":
        worker, _ = request.getfixturevalue("tiny_llama")
        rng = random.Random(7)
        documents = [[rng.randrange(3, 320) for _ in range(15 * 16)] for _ in range(3)]
        questions = [[rng.randrange(3, 320) for _ in range(9)] for _ in range(2)]
        return worker, documents, questions
    worker = request.getfixturevalue("smollm_worker")
    tokenizer = request.getfixturevalue("smollm_tokenizer")
    paragraph = ("The lighthouse keeper wrote down every ship that passed the cape, its flag, its cargo and the "
                 "weather, in a ledger that grew thicker each winter. ")
    documents = [tokenizer.encode(f"Ledger {name}. " + paragraph * 8) for name in ("one", "two", "three")]
    questions = [tokenizer.encode(f" Question {r}: which ships passed?") for r in range(2)]
    return worker, documents, questions


def engine(worker, offload: KVOffloadConfig = KVOffloadConfig(), **scheduler) -> Engine:
    eng = Engine(cache_config=CacheConfig(num_gpu_blocks=worker.num_blocks),
                 scheduler_config=SchedulerConfig(max_num_batched_tokens=512, **scheduler), worker=worker,
                 kv_offload_config=offload)
    if eng.scheduler.offload is not None:
        # The tiny model computes a unit faster than a file is read (its disk hits would not be
        # credited, rightly): loads are made free so that every found block is loaded here.
        eng.scheduler.offload.host_seconds_per_unit = eng.scheduler.offload.disk_seconds_per_unit = 0.0
    return eng


def ask_in_turn(eng: Engine, model, rounds: int = 2) -> list:
    """Each document with a question, one after the other, round after round."""
    _, documents, questions = model
    results = []
    for r in range(rounds):
        for doc in documents:
            [result] = eng.generate([doc + questions[r]], GREEDY)
            results.append(result)
    return results


@pytest.fixture(scope="module")
def reference(model):
    return [r.token_ids for r in ask_in_turn(engine(model[0]), model)]


def test_round_two_loads_the_documents_from_the_host_tier_with_the_same_tokens(model, reference):
    eng = engine(model[0], KVOffloadConfig(kv_offloading_size=0.25))
    results = ask_in_turn(eng, model)
    assert [r.token_ids for r in results] == reference
    stats = eng.scheduler.stats()
    # Round 2: every full block of each document came from the host tier or the device.
    for result in results[3:]:
        assert result.num_cached_tokens >= len(result.prompt_token_ids) - 2 * 16
    assert stats["prompt_tokens_external_kv_transfer"] > 0
    assert stats["kv_offload_bytes"]["GPU_to_CPU"] > 0 and stats["kv_offload_bytes"]["CPU_to_GPU"] > 0
    assert stats["kv_offload_load_failures"] == 0


def test_a_fresh_engine_finds_the_blocks_on_disk_and_a_corrupt_file_is_recomputed(model, reference, tmp_path):
    worker = model[0]
    disk = KVOffloadConfig(kv_offloading_path=str(tmp_path))  # write-through: filed when a request ends
    first = engine(worker, disk)
    assert [r.token_ids for r in ask_in_turn(first, model, rounds=1)] == reference[:3]
    first.offload_worker.flush()  # its files are written
    assert unit_files(tmp_path)
    # A restarted engine (a new scheduler, empty host tier): round 2 reads the disk tier.
    restarted = engine(worker, disk)
    results = ask_in_turn(restarted, model, rounds=1)
    assert [r.token_ids for r in results] == reference[:3]
    stats = restarted.scheduler.stats()
    assert stats["kv_offload_block_hits"]["DISK"] > 0 and stats["kv_offload_bytes"]["DISK_to_GPU"] > 0
    assert results[0].num_cached_tokens >= len(model[1][0]) - 16
    # Every file damaged: the loads fail, the prompts are recomputed, the tokens stay the same.
    for path in map(Path, unit_files(tmp_path)):  # each file once (its names are hard links)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(data)
    third = engine(worker, disk)
    assert [r.token_ids for r in ask_in_turn(third, model, rounds=1)] == reference[:3]
    stats = third.scheduler.stats()
    assert stats["kv_offload_load_failures"] >= 1 and stats["kv_offload_corrupt_files"] >= 1


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preempted_requests_give_the_same_tokens_swapped_or_recomputed(model, mode):
    """Two long decodes that outgrow the pool together: one is preempted."""
    worker, documents, questions = model
    prompts = [doc + questions[0] for doc in documents[:2]]
    max_tokens = (worker.num_blocks // 2 + 2) * 16 - len(prompts[0])
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    plain = engine(worker, max_num_seqs=2).generate(prompts, params)
    eng = engine(worker, KVOffloadConfig(kv_offloading_size=0.25, preemption_mode=mode), max_num_seqs=2)
    results = eng.generate(prompts, params)
    assert eng.scheduler.num_preemptions >= 1
    assert [r.token_ids for r in results] == [r.token_ids for r in plain]
    if mode == "swap":
        assert eng.scheduler.stats()["kv_offload_bytes"]["CPU_to_GPU"] > 0  # swapped back in
    pool = eng.scheduler.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks
    assert not any(u.pins for u in eng.scheduler.offload.host.units.values())


def test_no_files_outside_the_namespace_folder(tmp_path, model):
    eng = engine(model[0], KVOffloadConfig(kv_offloading_path=str(tmp_path)))
    eng.generate([model[1][0]], GREEDY)
    eng.offload_worker.flush()
    [namespace] = os.listdir(tmp_path)
    assert namespace.endswith("-tp0of1") and all(p.suffix == ".kv" for p in Path(tmp_path).rglob("*") if p.is_file())
