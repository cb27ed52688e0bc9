"""P/D in the scheduler (no bus): hand-off after the first token, held blocks, loads that
finish, fail or time out, releases, and the decode side's own prefix cache."""

from services.scheduler.kv_connector import KVConnectorScheduler
from services.scheduler.request import Request, RequestStatus
from services.scheduler.scheduler import Scheduler
from shared.config import KV_CONSUMER, KV_PRODUCER, CacheConfig, KVTransferConfig, SchedulerConfig
from shared.protocol import FinishReason, ModelRunnerOutput, SamplingParams

BS = 4
EOS = 2


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def make_engine(role, engine_id, clock, num_blocks=32, **kv):
    config = KVTransferConfig(kv_role=role, kv_transfer_timeout=5.0, kv_hold_timeout=20.0, **kv)
    connector = KVConnectorScheduler(config, engine_id, f"inc-{engine_id}", BS, 1, clock=clock)
    return Scheduler(SchedulerConfig(async_scheduling=False), CacheConfig(block_size=BS), num_blocks, 256,
                     kv_connector=connector)


def prompt_request(req_id, prompt, max_tokens=5):
    request = Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), eos_token_id=EOS,
                      block_size=BS)
    request.do_remote_decode = True
    return request


def answer(sched, step, token=7, **extra):
    req_ids = step.scheduled_req_ids
    tokens = []
    for req_id in req_ids:
        req = sched.requests.get(req_id)
        tokens.append([token] if req is not None and req.num_computed_tokens >= req.num_tokens else [])
    return sched.update_from_output(step, ModelRunnerOutput(step.step_id, req_ids, tokens, **extra))


def hand_over(prefill, decode, prompt, req_id="r"):
    """Run the prompt on the prefill engine and give the request to the decode engine as
    the scheduler service does; returns (decode request, prefill step outputs)."""
    prefill.add_request(prompt_request(req_id, prompt))
    step = prefill.schedule()
    outputs = answer(prefill, step, token=9)
    [(held, params)] = prefill.take_handoffs()
    request = Request(req_id, prompt, held.sampling_params, eos_token_id=EOS, block_size=BS)
    for token in held.output_token_ids:
        request.append_output_token(token)
    request.kv_transfer_params = params
    request.came_by_handoff = True
    request.num_cached_tokens = 0
    decode.add_request(request)
    return request, outputs


def test_prefill_side_hands_off_after_one_token_and_holds_blocks_until_released():
    clock = Clock()
    prefill = make_engine(KV_PRODUCER, "p", clock)
    decode = make_engine(KV_CONSUMER, "d", clock)
    _, outputs = hand_over(prefill, decode, list(range(10, 20)))
    assert [(o.new_token_ids, o.finish_reason) for o in outputs] == [([9], FinishReason.NONE)]
    assert prefill.requests == {} and not prefill.has_unfinished_requests()
    held = prefill.connector.holds["r"].request
    block_ids = prefill.kv_cache_manager.get_block_ids("r")
    assert len(block_ids) == 3  # 10 prompt tokens, blocks of 4
    step = prefill.schedule()  # a step with nothing to run still carries the metadata
    assert prefill.step_worth_sending(step)
    assert step.finished_req_ids == ["r"]
    assert [(s.req_id, s.block_ids) for s in step.kv_connector_metadata.reqs_to_send] == [("r", block_ids)]
    assert prefill.release_held(["r"], "another-incarnation") == 0
    assert prefill.release_held(["r"], "inc-p") == 1
    assert prefill.release_held(["r"], "inc-p") == 0  # idempotent
    assert prefill.kv_cache_manager.num_free_blocks == 32
    assert prefill.schedule().kv_connector_metadata.reqs_not_to_send == ["r"]
    assert held.finish_reason == FinishReason.NONE


def test_prefill_side_answers_a_resend_of_a_handed_off_request_naming_the_new_owner():
    """A gateway that lost the output naming the decode engine (its detokenizer died) asks the
    prefill engine, which it still watches, to resend: the answer names the owner, so the
    gateway watches the decode engine from then on (and fails the request if that is gone)."""
    prefill = make_engine(KV_PRODUCER, "p", Clock())
    decode = make_engine(KV_CONSUMER, "d", Clock())
    hand_over(prefill, decode, list(range(10, 20)))
    held = prefill.connector.holds["r"].request
    assert prefill.resend_output("r", 0) is None  # taken by no decode engine yet
    prefill.remember_handoff(held, "d", "inc-d")
    resent = prefill.resend_output("r", 0)
    assert (resent.new_token_ids, resent.finish_reason) == ([9], FinishReason.NONE)
    assert (resent.owner_engine_id, resent.owner_incarnation) == ("d", "inc-d")
    assert prefill.resend_output("r", 1).new_token_ids == []  # past the first token: the owner named still


def test_decode_side_loads_then_runs_from_the_loaded_prompt():
    clock = Clock()
    prefill = make_engine(KV_PRODUCER, "p", clock)
    decode = make_engine(KV_CONSUMER, "d", clock)
    request, _ = hand_over(prefill, decode, list(range(10, 20)))
    step = decode.schedule()
    assert step.scheduled_req_ids == []  # nothing runs: the KV is loading
    [spec] = step.kv_connector_metadata.reqs_to_recv
    assert (spec.req_id, spec.first_block, spec.remote_engine_id, spec.remote_incarnation) == ("r", 0, "p", "inc-p")
    assert spec.block_ids == decode.kv_cache_manager.get_block_ids("r") and len(spec.block_ids) == 3
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert decode.stats()["num_requests_waiting_for_remote_kv"] == 1
    idle = decode.schedule()
    assert not decode.step_worth_sending(idle)  # the workers push the load's end: no step to ask
    polling = decode.schedule(poll_kv_loads=True)
    assert decode.step_worth_sending(polling, poll_kv_loads=True) and polling.step_id == step.step_id + 1
    answer(decode, step, finished_recving=["r"], kv_bytes_recvd=1000)
    assert decode.connector.take_releases() == {("p", "inc-p"): ["r"]}
    step = decode.schedule()
    [new] = step.scheduled_new_reqs
    assert (new.num_computed_tokens, new.output_token_ids) == (10, [9])
    assert dict(zip(step.scheduled_req_ids, step.num_scheduled_tokens)) == {"r": 1}
    outputs = answer(decode, step, token=11)
    assert outputs[0].new_token_ids == [11] and outputs[0].owner_engine_id == "d"
    stats = decode.stats()
    assert (stats["kv_transfer_requests"], stats["kv_transfer_bytes"], stats["kv_transfer_fallbacks"]) == (1, 1000, 0)


def test_decode_side_pulls_only_blocks_its_prefix_cache_lacks():
    clock = Clock()
    prefill = make_engine(KV_PRODUCER, "p", clock)
    decode = make_engine(KV_CONSUMER, "d", clock)
    shared_prefix = list(range(10, 18))  # two full blocks
    decode.add_request(Request("warm", shared_prefix + [50, 51], SamplingParams(max_tokens=1), block_size=BS))
    answer(decode, decode.schedule())
    hand_over(prefill, decode, shared_prefix + [60, 61, 62])
    [spec] = decode.schedule().kv_connector_metadata.reqs_to_recv
    assert spec.first_block == 2 and len(spec.block_ids) == 1  # the cached 8 tokens stay local


def test_failed_or_late_load_recomputes_the_prompt_and_releases():
    clock = Clock()
    prefill = make_engine(KV_PRODUCER, "p", clock)
    decode = make_engine(KV_CONSUMER, "d", clock)
    hand_over(prefill, decode, list(range(10, 20)), "a")
    hand_over(prefill, decode, list(range(30, 40)), "b")
    step = decode.schedule()
    assert len(step.kv_connector_metadata.reqs_to_recv) == 2
    answer(decode, step, failed_recving=["a"])
    clock.now += 6  # past b's transfer deadline
    step = decode.schedule()
    assert sorted(step.kv_connector_metadata.reqs_to_cancel) == ["a", "b"]
    assert sorted(r.req_id for r in step.scheduled_new_reqs) == ["a", "b"]
    assert {n.req_id: (n.num_computed_tokens, n.output_token_ids) for n in step.scheduled_new_reqs} == {
        "a": (0, [9]), "b": (0, [9])}
    assert dict(zip(step.scheduled_req_ids, step.num_scheduled_tokens)) == {"a": 11, "b": 11}
    assert decode.connector.take_releases() == {("p", "inc-p"): ["a", "b"]}
    assert decode.stats()["kv_transfer_fallbacks"] == 2


def test_aborted_load_is_cancelled_and_a_lost_release_frees_at_the_hold_timeout():
    clock = Clock()
    prefill = make_engine(KV_PRODUCER, "p", clock)
    decode = make_engine(KV_CONSUMER, "d", clock)
    hand_over(prefill, decode, list(range(10, 20)))
    decode.schedule()
    decode.abort_requests(["r"])
    assert decode.schedule().kv_connector_metadata.reqs_to_cancel == ["r"]
    assert decode.kv_cache_manager.num_free_blocks == 32
    assert decode.connector.take_releases() == {("p", "inc-p"): ["r"]}  # (lost on its way)
    clock.now += 21
    step = prefill.schedule()
    assert step.kv_connector_metadata.reqs_not_to_send == ["r"]
    assert prefill.kv_cache_manager.num_free_blocks == 32


def test_no_decode_engine_decodes_locally_from_the_prefix_cache():
    clock = Clock()
    prefill = make_engine(KV_PRODUCER, "p", clock)
    prefill.add_request(prompt_request("r", list(range(10, 20))))
    answer(prefill, prefill.schedule(), token=9)
    [(request, _)] = prefill.take_handoffs()
    prefill.decode_locally(request)
    step = prefill.schedule()
    [new] = step.scheduled_new_reqs
    assert (new.num_computed_tokens, new.output_token_ids) == (8, [9])  # two cached blocks hit
    outputs = answer(prefill, step, token=11)
    assert outputs[0].new_token_ids == [11] and not prefill.take_handoffs()
