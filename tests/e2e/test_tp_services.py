"""Tensor parallelism through the real services over NATS, driven with the ``openai`` client.

One stack with three worker ranks (gloo on CPU) on the default SmolLM2 model (9
query heads, 3 KV heads: one KV head per rank), a scheduler, a tokenizer, a
detokenizer and a gateway, each a real process. Greedy chat outputs equal Hugging
Face's token for token (a difference only at a near tie of HF's logits); a seeded
sampled request equals the single-process TP=1 engine's; each rank reports the KV
capacity of its own share of the cache.
"""

from __future__ import annotations

import asyncio

import msgspec
import nats
import pytest
from openai import AsyncOpenAI

from services.engine import Engine
from services.launch.nats_server import free_port
from services.launch.stack import StackConfig
from shared.config import CacheConfig, SchedulerConfig
from shared.protocol import WORKER_READY, SamplingParams, engine_ready_subject
from tests.e2e.stacks import running_stack

MODEL = "SmolLM2-135M-Instruct"
TP = 3
NUM_TOKENS = 16
KV_GIB = 0.05  # per rank: the block count each rank reports follows from its own KV heads
QUESTIONS = [
    "What is the capital of France?",
    "Write one sentence about cats.",
    "Give me a synonym for happy.",
]
GREEDY = {"temperature": 0.0, "max_tokens": NUM_TOKENS, "extra_body": {"ignore_eos": True}}
SEEDED = {"temperature": 0.8, "top_p": 0.95, "seed": 4242, "max_tokens": NUM_TOKENS, "extra_body": {"ignore_eos": True}}


def messages(question):
    return [{"role": "user", "content": question}]


@pytest.fixture(scope="module")
def tp_stack(tmp_path_factory):
    config = StackConfig(
        port=free_port(),
        tensor_parallel_size=TP,
        args=["--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--cpu-kv-cache-gib", str(KV_GIB),
              "--quantization", "none"],
        log_dir=str(tmp_path_factory.mktemp("tp-stack-logs")),
    )
    with running_stack(config) as stack:
        yield stack


@pytest.fixture(scope="module")
def client(tp_stack):
    return AsyncOpenAI(base_url=tp_stack.base_url + "/v1", api_key="unused", max_retries=0)


def chat_prompt_ids(tokenizer, question):
    return tokenizer.encode(tokenizer.apply_chat_template(messages(question)), add_special_tokens=False)


def assert_text_matches_greedy(text, ref_tokens, gaps, tokenizer, tie_tolerance=1e-3):
    """``text`` is HF's greedy text, or departs from it first where HF's top-2 gap is a near tie."""
    want = tokenizer.decode(ref_tokens)
    if text == want:
        return
    k = next(
        (k for k in range(len(ref_tokens)) if not text.startswith(tokenizer.decode(ref_tokens[: k + 1]))),
        len(ref_tokens),
    )
    assert k < len(ref_tokens) and gaps[k] < tie_tolerance, (
        f"TP={TP} text departs from HF's greedy text at token {k} (HF's top-2 gap "
        f"{gaps[k] if k < len(gaps) else float('nan'):.2e}, not a near tie)\nours: {text!r}\nHF:   {want!r}"
    )


async def test_tp3_greedy_chat_equals_hf(client, hf_smollm_greedy, smollm_tokenizer):
    prompts = [chat_prompt_ids(smollm_tokenizer, q) for q in QUESTIONS]
    refs = hf_smollm_greedy(prompts, NUM_TOKENS, stop_at_eos=False)
    responses = await asyncio.wait_for(
        asyncio.gather(
            *(client.chat.completions.create(model=MODEL, messages=messages(q), **GREEDY) for q in QUESTIONS)
        ),
        timeout=180,
    )
    for resp, (tokens, gaps) in zip(responses, refs):
        assert resp.usage.completion_tokens == NUM_TOKENS
        assert resp.choices[0].finish_reason == "length"
        assert_text_matches_greedy(resp.choices[0].message.content, tokens, gaps, smollm_tokenizer)


async def test_tp3_seeded_sampling_equals_tp1_engine(client, smollm_worker, smollm_tokenizer):
    """Every rank samples alike: otherwise the ranks' cached tokens, and so the text, would drift."""
    q = QUESTIONS[1]
    resp = await asyncio.wait_for(client.chat.completions.create(model=MODEL, messages=messages(q), **SEEDED), 120)
    engine = Engine(
        cache_config=CacheConfig(num_gpu_blocks=smollm_worker.num_blocks),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=256),
        worker=smollm_worker,
    )
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=4242, max_tokens=NUM_TOKENS, ignore_eos=True)
    want = engine.generate([chat_prompt_ids(smollm_tokenizer, q)], params)[0].token_ids
    assert resp.choices[0].message.content == smollm_tokenizer.decode(want)


async def test_each_rank_reports_its_own_kv_share(tp_stack, smollm_worker):
    nc = await nats.connect(tp_stack.nats.url, **tp_stack.nats.credentials("admin"))
    seen = {}
    done = asyncio.Event()

    async def on_ready(msg):
        ready = WORKER_READY.decode(msg.data)
        seen[ready.rank] = ready
        if len(seen) == TP:
            done.set()

    try:
        await nc.subscribe(engine_ready_subject("0"), cb=on_ready)
        await asyncio.wait_for(done.wait(), 10)  # the ranks heartbeat their ready message
    finally:
        await nc.close()
    cfg = smollm_worker.model_config
    kv_heads_per_rank = cfg.num_key_value_heads // TP
    block_bytes = 2 * 16 * kv_heads_per_rank * cfg.head_dim * cfg.num_hidden_layers * 4  # fp32
    for rank, ready in seen.items():
        assert ready.world_size == TP
        assert ready.num_blocks == int(KV_GIB * (1 << 30) // block_bytes), msgspec.to_builtins(ready)
