"""P/D stacks for the end-to-end tests: prompts, the colocated reference, engine stats."""

from __future__ import annotations

import asyncio

import nats
from openai import AsyncOpenAI

from services.launch.nats_server import free_port
from services.launch.stack import StackConfig
from shared.protocol import ENGINE_STATS, ENGINE_STATS_MSG, EngineStats

MODEL = "SmolLM2-135M-Instruct"
NUM_TOKENS = 12
GREEDY = {"temperature": 0.0, "max_tokens": NUM_TOKENS, "extra_body": {"ignore_eos": True}}
PD_ARGS = ["--cpu-kv-cache-gib", "0.3", "--max-num-seqs", "32"]

PARAGRAPH = ("The river wound through the valley, past orchards and stone walls, and the people of the town "
             "kept careful records of every flood, every harvest and every traveller who crossed the old bridge. ")
QUESTIONS = ["What is the capital of France?", "Name three colours.", "Why is the sky blue?",
             "Write a haiku about rain.", "Count from one to five.", "What do bees make?"]


def pd_config(log_dir, tp: int = 1, args: list[str] = (), env: dict | None = None) -> StackConfig:
    return StackConfig(port=free_port(), prefill_engines=1, decode_engines=1, tensor_parallel_size=tp,
                       args=[*PD_ARGS, *args], env=env or {}, log_dir=str(log_dir))


def pd_prompts(tokenizer) -> list[list[int]]:
    """16 prompts: short ones, two over 1,000 tokens sharing that prefix, four sharing a
    ~200-token prefix, a one-token prompt and one of exactly 64 tokens (whole blocks)."""
    long_prefix = tokenizer.encode(PARAGRAPH * 28)
    assert len(long_prefix) > 1000
    mid_prefix = tokenizer.encode(PARAGRAPH * 5)
    prompts = [tokenizer.encode(q) for q in QUESTIONS]
    prompts += [long_prefix + tokenizer.encode(" Summarise it."), long_prefix + tokenizer.encode(" Who crossed?")]
    prompts += [mid_prefix + tokenizer.encode(f" Question {i}: what happened next?") for i in range(4)]
    prompts += [tokenizer.encode("Hello")[:1], (tokenizer.encode(PARAGRAPH * 3))[:64]]
    prompts += [tokenizer.encode("Tell me a story about a dragon and a knight who became friends.")]
    prompts += [tokenizer.encode(PARAGRAPH * 12)]
    assert len(prompts) == 16
    return prompts


def colocated_texts(prompts: list[list[int]], tokenizer) -> list[str]:
    """The colocated engine's greedy texts (the in-process engine: same kernels, one process,
    float32 and dequantized as the stacks of ``running_stack``)."""
    from services.engine import Engine
    from shared.config import CacheConfig, ModelRunConfig
    from shared.protocol import SamplingParams

    engine = Engine(ModelRunConfig(dtype="float32", quantization="none"), CacheConfig(num_gpu_blocks=800))
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    results = engine.generate(prompts, params)
    return [tokenizer.decode(r.token_ids).rstrip("\ufffd") for r in results]


async def stream_completion(client: AsyncOpenAI, prompt: list[int], **params) -> str:
    stream = await client.completions.create(prompt=prompt, stream=True, **{"model": MODEL, **GREEDY, **params})
    return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])


def run_all(stack, prompts: list[list[int]], **params) -> list[str]:
    async def go():
        async with AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0,
                               timeout=300) as client:
            return await asyncio.gather(*(stream_completion(client, p, **params) for p in prompts))

    return asyncio.run(go())


def engine_stats(stack, seconds: float = 2.5) -> dict[str, EngineStats]:
    """The first stats each of the stack's engines publishes from now on (every engine
    publishes once a second), or those heard within ``seconds``."""
    engine_ids = {engine_id for engine_id, _ in stack.config.engines()}

    async def collect():
        nc = await nats.connect(stack.nats.url, **stack.nats.credentials("admin"))
        latest: dict[str, EngineStats] = {}
        try:
            sub = await nc.subscribe(ENGINE_STATS)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + seconds
            while loop.time() < deadline and not engine_ids <= set(latest):
                try:
                    msg = await sub.next_msg(timeout=max(0.01, deadline - loop.time()))
                except Exception:
                    continue
                stats = ENGINE_STATS_MSG.decode(msg.data)
                latest[stats.engine_id] = stats
        finally:
            await nc.close()
        return latest

    return asyncio.run(collect())


def kv_idle(stack) -> bool:
    """Both engines hold no KV blocks and run or wait for nothing."""
    stats = engine_stats(stack)
    return set(stats) >= {"prefill-0", "decode-0"} and all(
        s.kv_cache_usage_perc == 0 and not s.num_requests_running and not s.num_requests_waiting
        for s in stats.values())

