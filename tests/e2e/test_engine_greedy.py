"""The in-process engine against Hugging Face transformers, token for token.

Eight prompts of different lengths (some over 300 tokens) run as one batch with
chunked prefill forced (a small token budget) and preemption forced (a KV pool
too small for all at once), on the default SmolLM2 model and on a tiny random
Llama with GQA. Also: prefix caching and seeded sampling through the engine.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from services.engine import Engine
from services.scheduler.scheduler import Scheduler
from shared.config import CacheConfig, SchedulerConfig
from shared.protocol import FinishReason, SamplingParams
from shared.request_validation import InvalidRequest
from tests.greedy_compare import assert_greedy_matches
from tests.hf_reference import hf_greedy

NUM_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)

PARAGRAPH = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden screw press. "
    "Within decades, print shops spread across Europe, books became cheaper, and ideas "
    "travelled faster than ever before. Scholars argue about how much the press changed "
    "literacy, but few doubt that it transformed science, religion and politics. "
)
SEEDS = [
    "Hello",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why each of them is prime:",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    # Distinct openings: no shared prefix, so the long prompts really compete for blocks.
    "Read this. " + PARAGRAPH + "Summarise the paragraph above in one sentence:",
    "Exam text: " + PARAGRAPH * 2 + "Question: who combined movable type with a press? Answer:",
    "Source document. " + PARAGRAPH * 4 + "Translate the first sentence into French:",
    "Story so far: " + PARAGRAPH * 4 + "And then? " + "What happened next?",
]


def engine_for(worker, max_num_batched_tokens=64, prefix_caching=True, max_num_seqs=16):
    return Engine(
        cache_config=CacheConfig(num_gpu_blocks=worker.num_blocks, enable_prefix_caching=prefix_caching),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs),
        worker=worker,
    )


def assert_no_leaks(engine):
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert engine.worker.requests == {} and engine.worker.input_batch.num_reqs == 0


@pytest.fixture(scope="module")
def smollm_prompts(smollm_worker, smollm_tokenizer):
    prompts = [smollm_tokenizer.encode(text) for text in SEEDS]
    assert max(len(p) for p in prompts) > 300 and min(len(p) for p in prompts) < 10
    return prompts


@pytest.fixture(scope="module")
def smollm_refs(hf_smollm_greedy, smollm_prompts):
    return hf_smollm_greedy(smollm_prompts, NUM_TOKENS, stop_at_eos=False)


def test_requests_are_prepared_as_the_tokenizer_service_does():
    """Every EOS id of the model stops a request (the first is its eos_token_id), and a
    refused prompt leaves nothing queued. No model needed: a stand-in worker."""
    model_config = SimpleNamespace(vocab_size=100, eos_token_ids=[2, 7])
    engine = Engine(worker=SimpleNamespace(num_blocks=8, max_model_len=64, model_config=model_config,
                                          kv_sliding_windows=[0], use_speculative=lambda config: None))
    request = engine.scheduler.requests[engine.add_request([1, 2, 3], SamplingParams(stop_token_ids=[5]))]
    assert request.eos_token_id == 2 and request.sampling_params.stop_token_ids == [5, 7]
    ignoring = engine.scheduler.requests[engine.add_request([1], SamplingParams(ignore_eos=True, max_tokens=0))]
    assert ignoring.sampling_params.stop_token_ids == [] and ignoring.sampling_params.max_tokens == 63
    fresh = Engine(worker=engine.worker)
    with pytest.raises(InvalidRequest, match="temperature"):
        fresh.generate([[1, 2], [3, 4]], [SamplingParams(), SamplingParams(temperature=9.0)])
    assert not fresh.has_unfinished_requests()


def test_smollm_greedy_equals_hf_with_chunking_and_preemption(smollm_worker, smollm_prompts, smollm_refs):
    engine = engine_for(smollm_worker)
    # The pool cannot hold all eight requests at once: preemption must happen.
    total_blocks = sum(-(-(len(p) + NUM_TOKENS) // 16) for p in smollm_prompts)
    assert total_blocks > engine.scheduler.num_blocks
    results = engine.generate(smollm_prompts, GREEDY)
    assert engine.scheduler.num_preemptions > 0
    assert all(r.finish_reason == FinishReason.LENGTH for r in results)
    assert_greedy_matches([r.token_ids for r in results], smollm_refs, NUM_TOKENS)
    assert_no_leaks(engine)


def test_tiny_llama_greedy_equals_hf(tiny_llama):
    worker, hf_model = tiny_llama
    engine = engine_for(worker, max_num_batched_tokens=48)
    gen = torch.Generator().manual_seed(7)
    vocab = worker.model_config.vocab_size
    lengths = [3, 17, 40, 64, 120, 301, 333, 20]
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]
    refs = hf_greedy(hf_model, prompts, NUM_TOKENS, stop_at_eos=False)
    results = engine.generate(prompts, GREEDY)
    assert engine.scheduler.num_preemptions > 0
    assert_greedy_matches([r.token_ids for r in results], refs, NUM_TOKENS)
    assert_no_leaks(engine)


def test_prefix_caching_hits_every_shared_block_and_keeps_output(smollm_worker, smollm_tokenizer):
    shared = smollm_tokenizer.encode(PARAGRAPH * 2)
    first = shared + smollm_tokenizer.encode(" Question one: what did Gutenberg build?")
    second = shared + smollm_tokenizer.encode(" Question two: where did print shops spread?")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    cached = engine_for(smollm_worker, max_num_batched_tokens=512)
    out_first = cached.generate([first], params)[0]
    assert out_first.num_cached_tokens == 0
    out_second = cached.generate([second], params)[0]
    common = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert out_second.num_cached_tokens == (common // 16) * 16
    stats = cached.scheduler.kv_cache_manager.prefix_cache_stats
    assert stats.hits == out_second.num_cached_tokens
    assert_no_leaks(cached)

    uncached = engine_for(smollm_worker, max_num_batched_tokens=512, prefix_caching=False)
    plain = uncached.generate([first, second], params)
    assert [r.num_cached_tokens for r in plain] == [0, 0]
    assert [r.token_ids for r in plain] == [out_first.token_ids, out_second.token_ids]
    assert_no_leaks(uncached)


def test_no_leaks_after_aborts_mid_flight(smollm_worker, smollm_prompts):
    engine = engine_for(smollm_worker)
    ids = [engine.add_request(p, GREEDY) for p in smollm_prompts]
    for _ in range(6):
        engine.step()
    engine.abort(ids[::2])
    while engine.has_unfinished_requests():
        engine.step()
    engine.abort(ids[1::2])  # already finished: a no-op
    engine.flush()
    assert_no_leaks(engine)


def test_seeded_sampling_is_the_same_alone_and_in_a_mixed_batch(smollm_worker, smollm_prompts):
    seeded = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, seed=4242, max_tokens=16, ignore_eos=True)
    alone = engine_for(smollm_worker).generate([smollm_prompts[2]], seeded)[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)] * 4
    # Mixed with unseeded requests, a different chunking budget, and preemptions.
    engine = engine_for(smollm_worker, max_num_batched_tokens=40)
    batch = [smollm_prompts[6], smollm_prompts[2], smollm_prompts[7], smollm_prompts[0], smollm_prompts[5]]
    results = engine.generate(batch, [others[0], seeded, others[1], others[2], others[3]])
    assert results[1].token_ids == alone
    again = engine_for(smollm_worker).generate([smollm_prompts[2]], seeded)[0].token_ids
    assert again == alone
    assert_no_leaks(engine)


def test_logprobs_and_stop_token_ids_through_the_engine(smollm_worker, smollm_prompts, smollm_refs):
    engine = engine_for(smollm_worker)
    want, _ = smollm_refs[1]
    stop_at = want[5]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, logprobs=3, stop_token_ids=[stop_at])
    result = engine.generate([smollm_prompts[1]], params)[0]
    first_stop = want.index(stop_at)
    assert result.token_ids == want[: first_stop + 1]
    assert result.finish_reason == FinishReason.STOP
    assert len(result.logprobs) == len(result.token_ids)
    for token, lp in zip(result.token_ids, result.logprobs):
        assert lp.token_ids[0] == token and len(lp.token_ids) == 4
        assert lp.sampled_rank == 1 and lp.token_ids[1] == token  # greedy: top-1
        assert lp.logprobs[1] >= lp.logprobs[2] >= lp.logprobs[3]
    assert_no_leaks(engine)


def test_tiny_llama_greedy_equals_hf_on_the_triton_path(tiny_llama):
    """Every kernel from Triton (the interpreter on CPU), same tokens as HF."""
    from services.worker.model_runner import ModelRunner
    from shared.config import ModelRunConfig

    torch_worker, hf_model = tiny_llama
    worker = ModelRunner(
        ModelRunConfig(model=torch_worker.model_path, kernel_backend="triton", dtype="float32", quantization="none"),
        CacheConfig(num_gpu_blocks=16),
        SchedulerConfig(max_num_seqs=4),
    )
    assert worker.ops.name == "triton"
    engine = engine_for(worker, max_num_batched_tokens=24)
    gen = torch.Generator().manual_seed(3)
    vocab = worker.model_config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (5, 19, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    refs = hf_greedy(hf_model, prompts, 6, stop_at_eos=False)
    results = engine.generate(prompts, params)
    assert_greedy_matches([r.token_ids for r in results], refs, 6)
    assert_no_leaks(engine)


def test_requests_resumed_after_the_worker_lost_its_state_continue_the_same_greedy_text(
    smollm_worker, smollm_prompts, smollm_refs
):
    """As the scheduler service does when its worker dies: a new scheduler takes over the
    unfinished requests, its first step resets the worker's state and resends each
    request with the tokens it generated; the text goes on exactly as undisturbed."""
    engine = engine_for(smollm_worker)
    ids = [engine.add_request(p, GREEDY) for p in smollm_prompts]
    tokens = {i: [] for i in ids}

    def collect(outputs):
        for out in outputs:
            tokens[out.request_id].extend(out.new_token_ids)

    while sum(map(len, tokens.values())) < 40:
        collect(engine.step())
    old = engine.scheduler
    engine.scheduler = Scheduler(old.config, engine.cache_config, smollm_worker.num_blocks,
                                 smollm_worker.max_model_len, first_step_id=old.last_step_id + 1)
    assert engine.scheduler.resume_requests(list(old.running) + list(old.waiting)) == []
    resumed = [r for r in engine.scheduler.requests.values() if r.num_output_tokens]
    assert resumed, "some request had generated tokens before the restart"
    while engine.has_unfinished_requests():
        collect(engine.step())
    engine.flush()
    assert_greedy_matches([tokens[i] for i in ids], smollm_refs, NUM_TOKENS)
    assert_no_leaks(engine)
