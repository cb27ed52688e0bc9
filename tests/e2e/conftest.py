"""Fixtures that more than one end-to-end module uses, built once per session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def peft_adapters(hf_smollm, tmp_path_factory):
    """test_engine_lora's adapters (its ``ADAPTERS``) as ``LoRARequest``s by name, made once for
    it and test_engine_lora_gguf: the same folders, so their HF + PEFT references are shared
    (``hf_lora_greedy``)."""
    from shared.protocol import LoRARequest
    from tests.e2e.test_engine_lora import ADAPTERS
    from tests.lora_reference import make_peft_adapter

    root = tmp_path_factory.mktemp("loras")
    return {name: LoRARequest(name, str(make_peft_adapter(hf_smollm, root / name, **spec)))
            for name, spec in ADAPTERS.items()}


@pytest.fixture(scope="session")
def pd_prompts_and_texts(smollm_tokenizer):
    """``pd_stacks.pd_prompts`` and the one in-process engine's greedy texts for them, made once
    for the modules that compare a stack of several engines with one engine (P/D, DP)."""
    from tests.e2e.pd_stacks import colocated_texts, pd_prompts

    prompts = pd_prompts(smollm_tokenizer)
    return prompts, colocated_texts(prompts, smollm_tokenizer)
