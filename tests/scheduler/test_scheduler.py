"""Scheduler decisions: budget and chunking, admission, preemption, abort, stops."""

import pytest

from services.scheduler.request import Request, RequestStatus
from services.scheduler.scheduler import RequestRejected, Scheduler
from shared.config import CacheConfig, SchedulerConfig
from shared.protocol import FinishReason, ModelRunnerOutput, SamplingParams

BS = 4
EOS = 2


def make_scheduler(num_blocks=64, max_model_len=256, first_step_id=1, **kw):
    return Scheduler(SchedulerConfig(**kw), CacheConfig(block_size=BS), num_blocks, max_model_len, first_step_id)


def make_request(req_id, n_prompt, **params):
    params.setdefault("max_tokens", 100)
    base = 1000 * (1 + sum(map(ord, req_id)))  # distinct prompts: no prefix sharing
    return Request(req_id, list(range(base, base + n_prompt)), SamplingParams(**params),
                   eos_token_id=EOS, block_size=BS)


def run_step(sched, token_of=lambda req_id: 7):
    """Schedule one step and answer it like a worker would: a token for each
    request whose known tokens are all computed after the step."""
    out = sched.schedule()
    req_ids, tokens = [], []
    for req_id in out.scheduled_req_ids:
        req = sched.requests.get(req_id)
        req_ids.append(req_id)
        done = req is not None and req.num_computed_tokens == req.num_tokens
        tokens.append([token_of(req_id)] if done else [])
    results = sched.update_from_output(out, ModelRunnerOutput(out.step_id, req_ids, tokens))
    return out, results


def scheduled(out):
    return dict(zip(out.scheduled_req_ids, out.num_scheduled_tokens))


def test_budget_is_shared_running_first_then_waiting_chunked():
    sched = make_scheduler(max_num_batched_tokens=10)
    sched.add_request(make_request("a", 6))
    sched.add_request(make_request("b", 9))
    out, _ = run_step(sched)
    assert scheduled(out) == {"a": 6, "b": 4}  # b's prompt is chunked
    assert [r.req_id for r in out.scheduled_new_reqs] == ["a", "b"]
    assert out.total_num_scheduled_tokens == 10
    out, results = run_step(sched)
    # a decodes 1 token, b finishes its prompt (5 more).
    assert scheduled(out) == {"a": 1, "b": 5}
    assert out.scheduled_new_reqs == []  # the diff: no request is sent twice
    assert out.scheduled_cached_reqs.req_ids == ["a", "b"]
    assert out.scheduled_cached_reqs.num_computed_tokens == [6, 4]
    assert {r.request_id: r.new_token_ids for r in results} == {"a": [7], "b": [7]}


def test_long_prefill_threshold_caps_each_chunk():
    sched = make_scheduler(max_num_batched_tokens=100, long_prefill_token_threshold=8)
    sched.add_request(make_request("a", 20))
    sched.add_request(make_request("b", 3))
    out, _ = run_step(sched)
    assert scheduled(out) == {"a": 8, "b": 3}
    out, _ = run_step(sched)
    assert scheduled(out) == {"a": 8, "b": 1}


def test_chunked_prefill_off_waits_for_room():
    sched = make_scheduler(max_num_batched_tokens=10, enable_chunked_prefill=False)
    sched.add_request(make_request("a", 6))
    sched.add_request(make_request("b", 9))
    out, _ = run_step(sched)
    assert scheduled(out) == {"a": 6}


def test_max_num_seqs_limits_running():
    sched = make_scheduler(max_num_seqs=2)
    for name in "abc":
        sched.add_request(make_request(name, 3))
    out, _ = run_step(sched)
    assert set(scheduled(out)) == {"a", "b"}
    assert [r.request_id for r in sched.waiting] == ["c"]


def test_new_blocks_are_sent_as_a_diff():
    sched = make_scheduler()
    sched.add_request(make_request("a", 4))
    out, _ = run_step(sched)
    assert out.scheduled_new_reqs[0].block_ids == [[0]]  # one KV cache group
    out, _ = run_step(sched)  # 5th token needs a second block
    assert out.scheduled_cached_reqs.new_block_ids == [[[1]]]
    out, _ = run_step(sched)
    assert out.scheduled_cached_reqs.new_block_ids == [[[]]]


def test_preemption_takes_the_last_admitted_and_recomputes_it():
    # 5 blocks of 4 tokens: a and b each take 2 blocks for 8-token prompts.
    sched = make_scheduler(num_blocks=5, max_model_len=20)
    sched.add_request(make_request("a", 8))
    sched.add_request(make_request("b", 8))
    out, _ = run_step(sched)
    assert scheduled(out) == {"a": 8, "b": 8}
    # Each now needs a third block; only one is free, so b (admitted last) goes.
    out, _ = run_step(sched)
    assert scheduled(out) == {"a": 1}
    b = sched.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert list(sched.waiting) == [b]
    assert sched.num_preemptions == 1
    assert sched.kv_cache_manager.get_block_ids("b") == []
    # a finishes; b comes back resumed, recomputing prompt + its output token.
    sched.abort_requests(["a"])
    out, _ = run_step(sched)
    assert out.scheduled_cached_reqs.req_ids == ["b"]
    assert out.scheduled_cached_reqs.resumed_from_preemption == [True]
    # Its first two blocks were still in the prefix cache: only the rest is computed.
    assert out.scheduled_cached_reqs.num_computed_tokens == [8]
    assert scheduled(out) == {"b": 1}
    assert out.finished_req_ids == ["a"]


def test_preemption_of_the_only_request_never_happens_thanks_to_length_cap():
    sched = make_scheduler(num_blocks=2, max_model_len=1000)
    assert sched.max_model_len == 8
    sched.add_request(make_request("a", 6, max_tokens=100))
    results = []
    for _ in range(5):
        _, r = run_step(sched)
        results += r
    assert results[-1].finish_reason == FinishReason.LENGTH
    assert sum(len(r.new_token_ids) for r in results) == 2  # 6 + 2 = 8 tokens
    assert sched.kv_cache_manager.num_free_blocks == 2


def test_abort_running_and_waiting_frees_blocks_and_tells_workers():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("a", 5))
    sched.add_request(make_request("b", 5))
    run_step(sched)
    aborted = sched.abort_requests(["a", "b", "unknown"])
    assert [r.request_id for r in aborted] == ["a", "b"]
    assert all(r.finish_reason == FinishReason.ABORT for r in aborted)
    assert sched.kv_cache_manager.num_free_blocks == 64
    assert not sched.has_unfinished_requests()
    out = sched.schedule()
    assert out.finished_req_ids == ["a"]  # b never reached a worker
    assert out.total_num_scheduled_tokens == 0


def test_output_of_an_aborted_request_is_dropped():
    sched = make_scheduler()
    sched.add_request(make_request("a", 3))
    out = sched.schedule()
    sched.abort_requests(["a"])
    results = sched.update_from_output(out, ModelRunnerOutput(out.step_id, ["a"], [[5]]))
    assert results == []


@pytest.mark.parametrize(
    "params, tokens, n_out, reason, stop_reason",
    [
        ({}, [5, EOS, 5], 2, FinishReason.STOP, None),
        ({"ignore_eos": True, "max_tokens": 3}, [5, EOS, 5], 3, FinishReason.LENGTH, None),
        ({"stop_token_ids": [9]}, [5, 9, 5], 2, FinishReason.STOP, 9),
        ({"max_tokens": 2}, [5, 5, 5], 2, FinishReason.LENGTH, None),
        ({"min_tokens": 3}, [EOS, 9, 5, EOS], 4, FinishReason.STOP, None),
        ({"min_tokens": 2, "stop_token_ids": [9]}, [9, 9], 2, FinishReason.STOP, 9),
        ({"stop_token_ids": [EOS]}, [5, EOS], 2, FinishReason.STOP, None),  # vLLM: EOS first
    ],
)
def test_stop_conditions(params, tokens, n_out, reason, stop_reason):
    sched = make_scheduler()
    sched.add_request(make_request("a", 3, **{"max_tokens": 100, **params}))
    stream = iter(tokens)
    results = []
    for _ in range(len(tokens)):
        _, r = run_step(sched, lambda _id: next(stream))
        results += r
        if r and r[-1].finish_reason != FinishReason.NONE:
            break
    generated = [t for r in results for t in r.new_token_ids]
    assert generated == tokens[:n_out]
    assert results[-1].finish_reason == reason
    assert results[-1].stop_reason == stop_reason  # vLLM's: the stop token id, None for EOS / length
    assert all(r.stop_reason is None for r in results[:-1])
    assert sched.kv_cache_manager.num_free_blocks == 64


def test_max_model_len_stops_with_length():
    sched = make_scheduler(max_model_len=6)
    sched.add_request(make_request("a", 4))
    results = []
    for _ in range(4):
        results += run_step(sched)[1]
    assert [len(r.new_token_ids) for r in results] == [1, 1]
    assert results[-1].finish_reason == FinishReason.LENGTH


def test_requests_that_can_never_run_are_rejected():
    sched = make_scheduler(num_blocks=4, max_model_len=100)  # pool holds 16 tokens
    with pytest.raises(RequestRejected, match="at most 15 prompt tokens"):
        sched.add_request(make_request("a", 16))
    with pytest.raises(RequestRejected, match="empty"):
        sched.add_request(make_request("b", 0))
    sched.add_request(make_request("c", 3))
    with pytest.raises(RequestRejected, match="already in use"):
        sched.add_request(make_request("c", 3))
    assert sched.get_num_unfinished_requests() == 1


def test_engine_output_carries_a_window_for_the_detokenizer():
    sched = make_scheduler()
    sched.add_request(make_request("a", 3, max_tokens=20))
    counter = iter(range(100, 200))
    results = []
    for _ in range(12):
        results += run_step(sched, lambda _id: next(counter))[1]
    last = results[-1]
    assert last.new_token_ids == [111]
    assert last.window_offset == 3 and last.window_token_ids == list(range(103, 112))
    assert last.num_prompt_tokens == 3


# ---------------------------------------------------------------- async scheduling


class PipelinedWorker:
    """Executes steps like a worker: it keeps each request's tokens, feeds the token it
    sampled itself into the next step, and samples when a step reaches the end of what it
    knows. The token at position p of request r is token_at(r, p)."""

    def __init__(self, token_at):
        self.token_at = token_at
        self.tokens: dict[str, int] = {}  # tokens known to the worker
        self.computed: dict[str, int] = {}
        self.num_sampled = 0

    def execute(self, out):
        for new in out.scheduled_new_reqs:
            self.tokens[new.req_id] = len(new.prompt_token_ids)
            self.computed[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for req_id, num_computed in zip(cached.req_ids, cached.num_computed_tokens):
            assert num_computed == self.computed[req_id], "scheduler and worker disagree on progress"
        sampled = []
        for req_id, n in zip(out.scheduled_req_ids, out.num_scheduled_tokens):
            self.computed[req_id] += n
            assert self.computed[req_id] <= self.tokens[req_id], "a step computes a token the worker lacks"
            if self.computed[req_id] == self.tokens[req_id]:
                sampled.append([self.token_at(req_id, self.tokens[req_id])])
                self.tokens[req_id] += 1
                self.num_sampled += 1
            else:
                sampled.append([])
        for req_id in out.finished_req_ids:
            self.tokens.pop(req_id, None)
            self.computed.pop(req_id, None)
        return ModelRunnerOutput(out.step_id, list(out.scheduled_req_ids), sampled)


def run_to_end(sched, worker, ahead: bool):
    """All requests to the end, one step at a time or with one step scheduled ahead."""
    results, in_flight = [], []
    while sched.has_unfinished_requests() or in_flight:
        while len(in_flight) < (2 if ahead else 1):
            out = sched.schedule(allow_preemption=not in_flight)
            if out.total_num_scheduled_tokens == 0:
                break
            in_flight.append((out, worker.execute(out)))
        out, result = in_flight.pop(0)
        results += sched.update_from_output(out, result)
    return results


def outputs_by_request(results):
    tokens, reasons = {}, {}
    for r in results:
        tokens.setdefault(r.request_id, []).extend(r.new_token_ids)
        if r.finish_reason != FinishReason.NONE:
            reasons[r.request_id] = r.finish_reason
    return tokens, reasons


def test_scheduling_ahead_gives_the_same_outputs_as_one_step_at_a_time():
    def token_at(req_id, position):
        if req_id == "eos" and position == 9:
            return EOS  # finishes while its next step is already in flight
        return 100 + position

    runs = []
    for ahead in (False, True):
        sched = make_scheduler(max_model_len=16, max_num_batched_tokens=8)
        sched.add_request(make_request("eos", 5))  # stops on EOS after 5 outputs
        sched.add_request(make_request("short", 3, max_tokens=4))
        sched.add_request(make_request("long", 12))  # chunked, then cut by max_model_len
        sched.add_request(make_request("stop", 4, stop_token_ids=[107]))
        worker = PipelinedWorker(token_at)
        results = run_to_end(sched, worker, ahead)
        assert sched.kv_cache_manager.num_free_blocks == 64 and not sched.requests
        runs.append((outputs_by_request(results), worker.num_sampled))
    (sync_outputs, sync_sampled), (async_outputs, async_sampled) = runs
    assert async_outputs == sync_outputs
    # Ahead, the two requests that stop on a token had one more computed in vain; those
    # that stop by length had none.
    assert (sync_sampled, async_sampled) == (17, 19)
    tokens, reasons = sync_outputs
    assert tokens["eos"] == [105, 106, 107, 108, EOS] and reasons["eos"] == FinishReason.STOP
    assert tokens["short"] == [103, 104, 105, 106] and reasons["short"] == FinishReason.LENGTH
    assert tokens["long"] == [112, 113, 114, 115] and reasons["long"] == FinishReason.LENGTH
    assert tokens["stop"] == [104, 105, 106, 107] and reasons["stop"] == FinishReason.STOP


def test_a_step_scheduled_ahead_runs_decodes_past_the_tokens_in_flight():
    sched = make_scheduler()
    sched.add_request(make_request("a", 5))
    first = sched.schedule()
    assert scheduled(first) == {"a": 5}
    ahead = sched.schedule(allow_preemption=False)  # before the first result is back
    assert scheduled(ahead) == {"a": 1}
    assert ahead.scheduled_cached_reqs.num_computed_tokens == [5]
    assert sched.requests["a"].num_output_placeholders == 2
    sched.update_from_output(first, ModelRunnerOutput(first.step_id, ["a"], [[7]]))
    results = sched.update_from_output(ahead, ModelRunnerOutput(ahead.step_id, ["a"], [[8]]))
    assert results[0].new_token_ids == [8]
    assert sched.requests["a"].output_token_ids == [7, 8]
    assert sched.requests["a"].num_output_placeholders == 0


def test_a_request_that_surely_finishes_is_not_scheduled_ahead():
    sched = make_scheduler()
    sched.add_request(make_request("a", 5, max_tokens=1))
    sched.add_request(make_request("b", 5, max_tokens=2))
    assert scheduled(sched.schedule()) == {"a": 5, "b": 5}
    ahead = sched.schedule(allow_preemption=False)
    assert scheduled(ahead) == {"b": 1}  # a's one token is already in flight


def test_nothing_is_preempted_while_a_step_is_in_flight():
    # 5 blocks of 4 tokens: a and b hold 2 each; both need a third block to go on.
    sched = make_scheduler(num_blocks=5, max_model_len=20)
    sched.add_request(make_request("a", 8))
    sched.add_request(make_request("b", 8))
    first = sched.schedule()
    ahead = sched.schedule(allow_preemption=False)
    assert scheduled(ahead) == {"a": 1}  # b waits for a block instead of being preempted
    assert sched.num_preemptions == 0 and sched.requests["b"].status == RequestStatus.RUNNING
    sched.update_from_output(first, ModelRunnerOutput(first.step_id, ["a", "b"], [[7], [7]]))
    sched.update_from_output(ahead, ModelRunnerOutput(ahead.step_id, ["a"], [[7]]))
    out = sched.schedule()  # nothing in flight: now b is preempted
    assert scheduled(out) == {"a": 1}
    assert sched.num_preemptions == 1 and sched.requests["b"].status == RequestStatus.PREEMPTED


def test_outputs_flag_stop_strings_which_a_resend_and_a_query_still_get():
    sched = make_scheduler()
    sched.add_request(make_request("s", 4, max_tokens=2, stop=["ab", "cde"]))
    assert sched.stop_strings("s").stop == ["ab", "cde"] and sched.stop_strings("other") is None
    _, [first] = run_step(sched)
    assert first.has_stop and first.stop == []
    assert sched.resend_output("s", 0).stop == ["ab", "cde"]
    _, [last] = run_step(sched)
    assert last.finish_reason == FinishReason.LENGTH and last.has_stop
    assert sched.stop_strings("s").stop == ["ab", "cde"]  # finished lately
    resent = sched.resend_output("s", 0)
    assert resent.stop == ["ab", "cde"] and not resent.has_stop and resent.new_token_ids == [7, 7]


def test_output_text_settings_travel_like_stop_strings():
    """Settings other than the default are flagged on step outputs (the detokenizers hold
    them) and carried by resent outputs; a request with none is not flagged."""
    sched = make_scheduler()
    sched.add_request(make_request("k", 4, max_tokens=2, skip_special_tokens=False, include_stop_str_in_output=True))
    sched.add_request(make_request("plain", 4, max_tokens=2))
    _, outputs = run_step(sched)
    flagged = {o.request_id: o.has_stop for o in outputs}
    assert flagged == {"k": True, "plain": False}
    entry = sched.stop_strings("k")
    assert (entry.stop, entry.skip_special_tokens, entry.include_stop_str_in_output) == ([], False, True)
    assert sched.resend_output("k", 0).text_settings == entry
    assert sched.resend_output("plain", 0).text_settings is None
