"""Prompt logprobs from the engine (scheduler + worker in one process) against Hugging Face.

The default model's log-softmax over a prompt, as transformers computes it, must match
ours at every position: the prompt token's logprob, its rank, and the top-n, with the
prompt prefilled in several chunks (``max_num_batched_tokens`` smaller than the prompt),
next to a request that does not want them, and for a prompt already in the prefix cache
(the request gets no cache hit, so every position is still computed).
"""

from __future__ import annotations

import torch

from services.engine import Engine
from shared.config import CacheConfig, SchedulerConfig
from shared.protocol import SamplingParams

PROMPT = ("Johannes Gutenberg introduced movable-type printing to Europe around 1440. "
          "His press spread quickly, and within decades printing shops operated in many cities.")
TOP_N = 3


def hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, list]:
    """Each request's prompt logprobs (from its first output), by request id."""
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    found: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.prompt_logprobs:
                assert out.request_id not in found  # sent once
                found[out.request_id] = out.prompt_logprobs
    engine.flush()
    return {i: found.get(i, []) for i in ids}


def check_against_hf(entries, ids: list[int], reference: torch.Tensor) -> None:
    assert len(entries) == len(ids)
    assert entries[0].token_ids == [ids[0]] and entries[0].logprobs == []  # nothing predicts it
    for p in range(1, len(ids)):
        entry, row = entries[p], reference[p - 1]
        assert entry.token_ids[0] == ids[p]
        assert abs(entry.logprobs[0] - row[ids[p]].item()) < 2e-3, p
        # Its rank: HF's logprob at that rank is the token's (ties may reorder equal values).
        assert abs(row.sort(descending=True).values[entry.sampled_rank - 1] - row[ids[p]]) < 2e-3
        top = row.topk(TOP_N)
        assert len(entry.token_ids) == 1 + TOP_N
        for got, want in zip(entry.logprobs[1:], top.values.tolist()):
            assert abs(got - want) < 2e-3


def test_prompt_logprobs_match_hugging_face_over_chunks_and_the_prefix_cache(smollm_worker, smollm_tokenizer,
                                                                             hf_smollm):
    ids = smollm_tokenizer.encode(PROMPT)
    assert len(ids) > 32  # three chunks of 16
    reference = hf_logprobs(hf_smollm, ids)
    engine = Engine(cache_config=CacheConfig(num_gpu_blocks=smollm_worker.num_blocks),
                    scheduler_config=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4), worker=smollm_worker)
    wanting = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP_N)
    plain = SamplingParams(temperature=0, max_tokens=2)
    first = run(engine, [ids, ids[:20]], [wanting, plain])
    [mine, other] = first.values()
    assert other == []  # not asked for: none
    check_against_hf(mine, ids, reference)
    # The prompt is in the prefix cache now; a request wanting prompt logprobs ignores it.
    again = run(engine, [ids], [wanting])
    check_against_hf(next(iter(again.values())), ids, reference)
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks
