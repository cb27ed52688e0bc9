"""The default model's one-token path (``LlamaForCausalLM.one_token``: every layer in one C
call, kernels/decode_layers.py) against its layers one by one: the same logits bit for bit
at every decode step of a request alone, so which of the two runs a batch-1 step changes
nothing (tests/e2e/test_batch_invariance.py compares batch 1 with larger batches)."""

from __future__ import annotations

import pytest
import torch

from kernels import decode_layers
from services.engine import Engine
from shared.config import CacheConfig, ModelRunConfig, SchedulerConfig
from shared.protocol import SamplingParams


@pytest.fixture(scope="module")
def default_worker(smollm_path):
    """The default model in bfloat16, the only dtype the one-token path runs. ``--dtype auto``
    picks it for these quantized weights on every CPU; it is asked for here so that the
    test does not depend on that choice."""
    from services.worker.model_runner import ModelRunner

    return ModelRunner(ModelRunConfig(model=smollm_path, kernel_backend="torch", dtype="bfloat16"),
                       CacheConfig(num_gpu_blocks=64), SchedulerConfig(max_num_seqs=4))


def logits_per_step(worker, prompt, one_token: bool, monkeypatch) -> tuple[list[torch.Tensor], int]:
    """Each step's logits of a 24-token greedy request alone, and how many steps the one-token
    path ran."""
    model = worker.model
    steps, taken = [], []
    compute_logits, own_path = model.compute_logits, model.one_token

    def record(hidden):
        logits = compute_logits(hidden)
        steps.append(logits.clone())
        return logits

    def path(*args):
        hidden = own_path(*args) if one_token else None
        taken.append(hidden is not None)
        return hidden

    monkeypatch.setattr(model, "compute_logits", record)
    monkeypatch.setattr(model, "one_token", path)
    engine = Engine(cache_config=CacheConfig(num_gpu_blocks=worker.num_blocks),
                    scheduler_config=SchedulerConfig(max_num_seqs=4), worker=worker)
    engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    monkeypatch.undo()
    return steps, sum(taken)


def test_one_token_steps_give_the_layers_logits_bit_for_bit(default_worker, smollm_tokenizer, monkeypatch):
    if not decode_layers.available():
        pytest.skip("the C kernels are not built")
    prompt = smollm_tokenizer.encode("The lighthouse keeper counted the ships that passed the harbour at night")
    fast, taken = logits_per_step(default_worker, prompt, True, monkeypatch)
    slow, not_taken = logits_per_step(default_worker, prompt, False, monkeypatch)
    assert taken == 23 and not_taken == 0  # every decode step, not the prompt's
    assert len(fast) == len(slow) == 24
    for a, b in zip(fast, slow):
        assert torch.equal(a, b)


def test_a_lora_wrapped_product_turns_the_one_token_path_off(default_worker):
    if not decode_layers.available():
        pytest.skip("the C kernels are not built")
    model = default_worker.model
    assert model._one_token_plan(default_worker.layer_kv_caches) is not None
    layer = model.layers[3].mlp.down_proj
    plain = layer.proj
    layer.proj = lambda x: plain(x)
    try:
        assert model._one_token_plan(default_worker.layer_kv_caches) is None
    finally:
        layer.proj = plain
    assert model._one_token_plan(default_worker.layer_kv_caches) is not None


def test_small_steps_give_the_same_logits_on_one_thread_and_on_two(default_worker, smollm_tokenizer, monkeypatch):
    """The worker picks a small step's threads by timing (services/worker/small_step_threads.py),
    so the count must change no bit: each decode step's logits with small steps on one
    thread equal those with them on two. The context passes 256 tokens, where two threads
    split the attention's KV heads too (kernels/cpu/paged_decode_attention.c)."""
    from services.worker.small_step_threads import SmallStepThreads

    sentence = "Twelve barrels of apples were loaded onto the cart before dawn. "
    prompt = smollm_tokenizer.encode(sentence * 20)
    assert 240 < len(prompt) < 256 + 24  # the decode steps cross 256 tokens of context
    runs = {}
    for mode in ("one", "all"):
        seen = []
        chooser = SmallStepThreads(2, mode)
        choose = chooser.threads

        def threads(small, choose=choose, seen=seen):
            count = choose(small)
            seen.append((small, count))
            return count

        monkeypatch.setattr(chooser, "threads", threads)
        monkeypatch.setattr(default_worker, "small_step_threads", chooser)
        runs[mode], _ = logits_per_step(default_worker, prompt, True, monkeypatch)
        assert seen[0] == (False, 2) and set(seen[1:]) == {(True, 1 if mode == "one" else 2)}
    assert len(runs["one"]) == len(runs["all"]) == 24
    for a, b in zip(runs["one"], runs["all"]):
        assert torch.equal(a, b)
