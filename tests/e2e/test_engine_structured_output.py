"""Structured output through the in-process engine on the default model: the mask
changes nothing it need not change (greedy), and constrained sampling survives
chunked prefill and forced preemption unchanged."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from services.engine import Engine
from services.scheduler.scheduler import Scheduler
from shared.config import CacheConfig, SchedulerConfig
from shared.protocol import FinishReason, SamplingParams
from shared.protocol import StructuredOutputsParams as Spec
from tests.e2e.test_engine_greedy import PARAGRAPH, assert_no_leaks

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 30},
        "year": {"type": "integer", "minimum": 1400, "maximum": 1600},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["print", "book", "ink"]},
                 "minItems": 1, "maxItems": 3},
    },
    "required": ["title", "year", "tags"],
}


def engine_for(worker, max_num_batched_tokens=64):
    return Engine(
        cache_config=CacheConfig(num_gpu_blocks=worker.num_blocks),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=16),
        worker=worker,
    )


@pytest.mark.parametrize("kind", ["choice", "regex"])
def test_greedy_under_a_grammar_that_allows_it_equals_unconstrained(smollm_worker, smollm_tokenizer, kind):
    engine = engine_for(smollm_worker)
    prompt = smollm_tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}])
    free = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24))[0]
    text = free.text
    spec = Spec(choice=[text, "red"]) if kind == "choice" else Spec(regex=re.escape(text) + r"[\s\S]*")
    constrained = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=spec))
    assert constrained[0].token_ids == free.token_ids
    assert_no_leaks(engine)


def test_sampled_json_is_unchanged_by_chunking_and_preemption(smollm_worker, smollm_tokenizer):
    """Six seeded requests: alone (no preemption), then all at once with the scheduler
    given 16 of the worker's blocks (preemption and recompute): the same valid outputs."""
    prompts = [
        smollm_tokenizer.apply_chat_template([{"role": "user", "content": f"Book {i}: describe it as JSON."}])
        for i in range(6)
    ]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=80, structured_outputs=Spec(json=json.dumps(SCHEMA)))
              for i in range(6)]
    engine = engine_for(smollm_worker, max_num_batched_tokens=48)
    engine.scheduler = Scheduler(engine.scheduler.config, engine.cache_config, 16, smollm_worker.max_model_len)
    alone = [engine.generate([p], sp)[0] for p, sp in zip(prompts, params)]
    assert engine.scheduler.num_preemptions == 0
    together = engine.generate(prompts, params)
    assert engine.scheduler.num_preemptions > 0
    for a, t in zip(alone, together):
        assert t.token_ids == a.token_ids
        assert t.finish_reason == FinishReason.STOP
        jsonschema.validate(json.loads(t.text), SCHEMA)
    assert_no_leaks(engine)
