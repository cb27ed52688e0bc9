"""A GGUF LoRA file through the in-process engine: the adapter made with ``peft`` on the
default model, written as llama.cpp's ``convert_lora_to_gguf.py`` writes it, gives the same
greedy tokens as its PEFT folder (in the same batch) and so as Hugging Face + PEFT."""

from __future__ import annotations

from shared.protocol import LoRARequest
from tests.e2e.test_engine_greedy import assert_no_leaks
from tests.e2e.test_engine_lora import (  # noqa: F401  (adapters, hf_refs, lora_worker, prompts: fixtures)
    GREEDY,
    NUM_TOKENS,
    adapters,
    hf_refs,
    lora_engine,
    lora_worker,
    prompts,
)
from tests.greedy_compare import assert_greedy_matches
from tests.lora_reference import write_gguf_lora


def test_gguf_adapter_equals_its_peft_folder_and_hf_peft(lora_worker, hf_refs, adapters, prompts, tmp_path):
    peft = adapters["all-r8"]  # not rsLoRA: the GGUF format scales by alpha / r only
    config = lora_worker.model_config
    file = write_gguf_lora(peft.lora_path, tmp_path / "all-r8.gguf", num_heads=config.num_attention_heads,
                           num_kv_heads=config.num_key_value_heads)
    gguf = LoRARequest("all-r8-gguf", str(file))
    few = prompts[:3]
    engine = lora_engine(lora_worker, max_num_batched_tokens=512)
    results = engine.generate(few * 2, GREEDY, [gguf] * len(few) + [peft] * len(few))
    from_gguf, from_peft = [r.token_ids for r in results[: len(few)]], [r.token_ids for r in results[len(few):]]
    assert from_gguf == from_peft
    assert_greedy_matches(from_gguf, hf_refs(few, peft), NUM_TOKENS)
    assert_no_leaks(engine)
