"""Requests of an engine whose workers died resume on a new scheduler: recomputed from
prompt + generated tokens, their outputs continuing at the offset the client reached."""

from services.scheduler.request import RequestStatus
from shared.protocol import FinishReason

from .test_scheduler import BS, make_request, make_scheduler, run_step


def test_unfinished_requests_resume_where_their_output_stopped():
    old = make_scheduler(max_num_batched_tokens=64)
    old.add_request(make_request("a", 6))
    old.add_request(make_request("b", 9, max_tokens=5))
    old.add_request(make_request("c", 5))
    step = iter(range(100, 200))
    for _ in range(3):
        run_step(old, token_of=lambda req_id: next(step))
    old.schedule()  # a step in flight when the workers died: its tokens are never reported
    before = {r.request_id: list(r.output_token_ids) for r in old.requests.values()}
    assert all(len(tokens) == 3 for tokens in before.values())

    new = make_scheduler(num_blocks=32, max_num_batched_tokens=64, first_step_id=old.last_step_id + 1)
    survivors = list(old.running) + list(old.waiting)
    assert new.resume_requests(survivors) == []
    out, results = run_step(new, token_of=lambda req_id: 7)
    assert out.reset_state and out.step_id == 5  # step ids go on: old results never match
    # Sent as new requests, with the tokens they generated, recomputed whole.
    sent = {r.req_id: r for r in out.scheduled_new_reqs}
    assert {k: v.output_token_ids for k, v in sent.items()} == before
    assert {k: v.num_computed_tokens for k, v in sent.items()} == {"a": 0, "b": 0, "c": 0}
    assert dict(zip(out.scheduled_req_ids, out.num_scheduled_tokens)) == {"a": 9, "b": 12, "c": 8}
    # The outputs continue at offset 3: no token is reported twice.
    for output in results:
        assert output.new_token_ids == [7]
        assert output.window_token_ids[-1] == 7
        assert output.window_offset + len(output.window_token_ids) == 4
    b = new.requests["b"]
    assert b.num_output_tokens == 4 and b.status == RequestStatus.RUNNING
    out, _ = run_step(new)
    assert not out.reset_state and out.step_id == 6
    assert "b" not in new.requests  # max_tokens=5 counts the tokens from before the restart
    assert new.kv_cache_manager.usage() > 0
    new.abort_requests(list(new.requests))
    assert new.kv_cache_manager.usage() == 0


def test_requests_too_long_for_the_new_engine_are_returned():
    old = make_scheduler()
    old.add_request(make_request("long", 30))
    old.add_request(make_request("short", 4))
    new = make_scheduler(num_blocks=4, max_model_len=64)  # 16 tokens of KV
    refused = new.resume_requests(list(old.waiting))
    assert [r.request_id for r in refused] == ["long"]
    assert list(new.requests) == ["short"]
    assert BS * 4 == new.max_model_len


def test_outputs_are_sent_again_from_an_offset():
    sched = make_scheduler()
    sched.add_request(make_request("a", 6, stop=["x"]))
    step = iter(range(100, 200))
    for _ in range(4):
        run_step(sched, token_of=lambda req_id: next(step))
    again = sched.resend_output("a", 1)
    assert again.new_token_ids == [101, 102, 103]
    assert again.window_offset + len(again.window_token_ids) == 4 and again.window_token_ids[-3:] == [101, 102, 103]
    assert again.stop == ["x"] and again.logprobs == []
    assert sched.resend_output("a", 4) is None  # nothing behind
    assert sched.resend_output("unknown", 0) is None


def test_a_finished_requests_last_outputs_can_be_sent_again():
    sched = make_scheduler()
    sched.add_request(make_request("done", 6, max_tokens=3))
    step = iter(range(100, 200))
    for _ in range(3):
        run_step(sched, token_of=lambda req_id: next(step))
    assert "done" not in sched.requests
    again = sched.resend_output("done", 1)
    assert again.new_token_ids == [101, 102] and again.finish_reason == FinishReason.LENGTH
    assert again.window_offset + len(again.window_token_ids) == 3 and again.num_prompt_tokens == 6
    end = sched.resend_output("done", 3)  # only its end was lost
    assert end.new_token_ids == [] and end.finish_reason == FinishReason.LENGTH
    assert sched.resend_output("done", 4) is None
