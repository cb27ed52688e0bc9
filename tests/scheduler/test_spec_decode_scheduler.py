"""The scheduler's side of speculative decoding: drafts as extra scheduled tokens,
their caps, the rollback of rejected ones, stops inside an accepted run, metrics."""

import pytest

from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from shared.config import CacheConfig, ConfigError, SchedulerConfig, parse_speculative_config
from shared.protocol import FinishReason, ModelRunnerOutput, SamplingParams

BS = 4
EOS = 2
NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}'


def make_scheduler(num_blocks=64, max_model_len=256, speculative_config=NGRAM, **kw):
    config = SchedulerConfig(speculative_config=speculative_config, **kw)
    return Scheduler(config, CacheConfig(block_size=BS), num_blocks, max_model_len)


def add(sched, req_id, n_prompt=6, **params):
    params.setdefault("max_tokens", 100)
    request = Request(req_id, list(range(100, 100 + n_prompt)), SamplingParams(**params), eos_token_id=EOS,
                      block_size=BS)
    sched.add_request(request)
    return request


def answer(sched, out, tokens_of, drafts_of=lambda req_id: 3):
    """Answer a step as the workers would: ``tokens_of(req_id, num_spec)`` for each request
    that samples, and how many drafts they now hold."""
    spec = dict(zip(out.scheduled_req_ids, out.num_spec_tokens))
    req_ids, tokens, drafts = [], [], []
    for req_id, n in zip(out.scheduled_req_ids, out.num_scheduled_tokens):
        request = sched.requests[req_id]
        req_ids.append(req_id)
        samples = request.num_computed_tokens - spec.get(req_id, 0) >= request.num_tokens
        tokens.append(tokens_of(req_id, spec.get(req_id, 0)) if samples else [])
        drafts.append(drafts_of(req_id) if samples else 0)
    runner = ModelRunnerOutput(out.step_id, req_ids, tokens, num_draft_tokens=drafts)
    return {o.request_id: o for o in sched.update_from_output(out, runner)}


def held_blocks(sched, req_id):
    return len(sched.kv_cache_manager.get_block_ids(req_id))


def test_drafts_are_scheduled_as_extra_tokens_and_rejected_ones_rolled_back():
    sched = make_scheduler()
    request = add(sched, "a", n_prompt=6)
    out = sched.schedule()  # the prompt
    assert out.num_spec_tokens == []
    answer(sched, out, lambda r, s: [7])
    assert request.num_draft_tokens == 3 and request.num_computed_tokens == 6 and request.num_tokens == 7

    out = sched.schedule()
    assert out.num_scheduled_tokens == [4] and out.num_spec_tokens == [3]
    assert request.num_computed_tokens == 10 and held_blocks(sched, "a") == 3  # slots for 10 tokens
    # One draft accepted, then the target's own token: 2 tokens, 2 drafts rejected.
    outputs = answer(sched, out, lambda r, s: [8, 9])
    assert outputs["a"].new_token_ids == [8, 9]
    assert request.num_tokens == 9 and request.num_computed_tokens == 8
    assert held_blocks(sched, "a") == 2  # the block that held only rejected drafts went back
    assert sched.spec_decode_stats.as_engine_stats() == {
        "spec_decode_num_drafts": 1, "spec_decode_num_draft_tokens": 3, "spec_decode_num_accepted_tokens": 1,
        "spec_decode_num_accepted_tokens_per_pos": [1, 0, 0],
    }

    out = sched.schedule()
    assert out.scheduled_cached_reqs.num_computed_tokens == [8]
    assert out.scheduled_cached_reqs.new_block_ids == [[[out.scheduled_cached_reqs.new_block_ids[0][0][0]]]]
    answer(sched, out, lambda r, s: [1, 1, 1, 1])  # every draft accepted, plus one
    assert request.num_tokens == 13 and request.num_computed_tokens == 12
    assert sched.spec_decode_stats.num_accepted_tokens_per_pos == [2, 1, 1]
    assert sched.spec_decode_stats.mean_acceptance_length == pytest.approx(1 + 4 / 2)


def test_drafts_respect_the_budget_max_tokens_and_max_model_len():
    sched = make_scheduler(max_num_batched_tokens=3)
    add(sched, "a", n_prompt=2)
    answer(sched, sched.schedule(), lambda r, s: [7])
    out = sched.schedule()
    assert out.num_scheduled_tokens == [3] and out.num_spec_tokens == [2]  # the budget

    sched = make_scheduler()
    add(sched, "a", n_prompt=2, max_tokens=3)
    answer(sched, sched.schedule(), lambda r, s: [7])
    out = sched.schedule()
    assert out.num_spec_tokens == [1]  # one output, one draft and one more make max_tokens
    outputs = answer(sched, out, lambda r, s: [7] * (s + 1))
    assert outputs["a"].finish_reason == FinishReason.LENGTH and len(sched.requests) == 0

    sched = make_scheduler(max_model_len=5)
    add(sched, "a", n_prompt=2)
    answer(sched, sched.schedule(), lambda r, s: [7])
    out = sched.schedule()
    assert out.num_spec_tokens == [1]  # 3 tokens, one draft and one more make max_model_len


def test_a_stop_inside_an_accepted_run_cuts_exactly_there():
    sched = make_scheduler()
    add(sched, "a", n_prompt=6)
    add(sched, "b", n_prompt=6, stop_token_ids=[42])
    answer(sched, sched.schedule(), lambda r, s: [7])
    outputs = answer(sched, sched.schedule(), lambda r, s: {"a": [5, EOS, 9, 9], "b": [42, 3]}[r])
    assert outputs["a"].new_token_ids == [5, EOS] and outputs["a"].finish_reason == FinishReason.STOP
    assert outputs["b"].new_token_ids == [42] and outputs["b"].finish_reason == FinishReason.STOP
    pool = sched.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_blocks


def test_min_tokens_lets_an_eos_inside_the_run_through():
    sched = make_scheduler()
    add(sched, "a", n_prompt=6, min_tokens=4)
    answer(sched, sched.schedule(), lambda r, s: [7])
    outputs = answer(sched, sched.schedule(), lambda r, s: [EOS, EOS, 5, EOS])
    assert outputs["a"].new_token_ids == [EOS, EOS, 5, EOS] and outputs["a"].finish_reason == FinishReason.STOP


def test_without_blocks_for_the_drafts_the_step_goes_on_without_them():
    sched = make_scheduler(num_blocks=3)
    add(sched, "a", n_prompt=6)
    add(sched, "b", n_prompt=3)
    answer(sched, sched.schedule(), lambda r, s: [7])
    assert sched.kv_cache_manager.num_free_blocks == 0
    out = sched.schedule()
    assert out.num_scheduled_tokens == [1, 1] and out.num_spec_tokens == [] and sched.num_preemptions == 0


def test_disable_by_batch_size_stops_drafts_while_more_requests_run():
    config = NGRAM.replace("}", ', "disable_by_batch_size": 1}')
    sched = make_scheduler(speculative_config=config)
    add(sched, "a")
    answer(sched, sched.schedule(), lambda r, s: [7])
    add(sched, "b")
    out = sched.schedule()
    assert dict(zip(out.scheduled_req_ids, out.num_scheduled_tokens))["a"] == 1 and out.num_spec_tokens == []
    answer(sched, out, lambda r, s: [7])
    sched.abort_requests(["b"])
    out = sched.schedule()
    assert out.num_scheduled_tokens == [4] and out.num_spec_tokens == [3]  # alone again


def test_no_drafts_are_scheduled_without_speculative_decoding():
    sched = make_scheduler(speculative_config="")
    add(sched, "a")
    answer(sched, sched.schedule(), lambda r, s: [7])
    out = sched.schedule()
    assert out.num_scheduled_tokens == [1] and out.num_spec_tokens == []
    assert sched.stats().get("spec_decode_num_drafts") is None


def test_speculative_decoding_turns_scheduling_ahead_off():
    assert SchedulerConfig().schedules_ahead
    assert not SchedulerConfig(speculative_config=NGRAM).schedules_ahead


@pytest.mark.parametrize("text, message", [
    ("{", "not valid JSON"),
    ("[1]", "must be a JSON object"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "method must be one of ngram"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}', "takes no key(s) model"),
    ('{"method": "ngram"}', "num_speculative_tokens is required"),
    ('{"method": "ngram", "num_speculative_tokens": "2"}', "must be an integer"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "must be in [1, 16]"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5}', "prompt_lookup_min <="),
    ('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": -1}', "must be >= 0"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', "needs model"),
    ('{"method": "draft_model", "model": 3, "num_speculative_tokens": 2}', "model must be a non-empty string"),
    ('{"method": "draft_model", "model": "d", "num_speculative_tokens": 2, "prompt_lookup_min": 2}',
     "takes no key(s) prompt_lookup_min"),
])
def test_a_bad_speculative_config_is_refused_at_start_up(text, message):
    with pytest.raises(ConfigError, match="speculative_config") as error:
        SchedulerConfig(speculative_config=text)
    assert message in str(error.value)


def test_a_good_speculative_config_is_parsed():
    config = parse_speculative_config(NGRAM)
    assert (config.method, config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max) == (
        "ngram", 3, 2, 4)
    assert parse_speculative_config("") is None
    config = parse_speculative_config('{"method": "draft_model", "model": "/m", "num_speculative_tokens": 5}')
    assert (config.method, config.model, config.num_speculative_tokens) == ("draft_model", "/m", 5)
