"""The V1 scheduler: one token budget per step, no prefill/decode phases.

Each step gives every request ``min(num_tokens - num_computed_tokens, budget)``
tokens, running requests first (in admission order), then waiting ones, so prompt
chunks and decodes share one batch. It produces the step as a diff for the workers
(``SchedulerOutput``) and turns the workers' sampled tokens back into per-request
outputs, finishing requests on EOS, stop token ids, max_tokens or max_model_len.

Pure and synchronous: no bus, no model. The scheduler service wraps it.

Steps may be scheduled ahead (async scheduling): ``schedule()`` may run again before the
previous step's output is back. Each request then counts the tokens its steps in flight
will sample (``num_output_placeholders``) and is scheduled past them; the workers feed
their own sampled tokens into the next step. A request that turns out to have finished
(EOS, a stop token) had one token computed in vain, which ``update_from_output`` drops;
one that certainly finishes (max_tokens, max_model_len) is not scheduled ahead. While a
step is in flight nothing is preempted: its blocks are still being written.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from dataclasses import dataclass

import msgspec

from shared.config import CacheConfig, SchedulerConfig
from shared.protocol import (
    CachedRequestData,
    EngineOutput,
    FinishReason,
    KVConnectorMetadata,
    ModelRunnerOutput,
    NewRequestData,
    RequestStopStrings,
    SchedulerOutput,
)
from shared.token_window import window_tokens

from .kv_cache_manager import KVCacheManager
from .kv_connector import KVConnectorScheduler
from .kv_events import KVEventRecorder
from .kv_offload.connector import OffloadingConnectorScheduler
from .request import Request, RequestStatus
from .spec_decode_stats import SpecDecodeStats

logger = logging.getLogger(__name__)


# How many finished requests' outputs are kept for resending (their output tokens only).
RECENTLY_FINISHED = 1024


@dataclass
class FinishedOutput:
    """What is left of a finished request to send its output again: its end (an output
    with no new token and its finish reason) and its output tokens."""

    end: EngineOutput
    output_token_ids: list[int]

    def output_from(self, token_offset: int) -> EngineOutput:
        new = self.output_token_ids[token_offset:]
        start = max(0, token_offset - window_tokens(self.end.stop))
        return msgspec.structs.replace(self.end, new_token_ids=new, window_token_ids=self.output_token_ids[start:],
                                       window_offset=start)


class RequestRejected(ValueError):
    """The request can never run on this engine (too long for the model or the pool)."""


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        max_model_len: int,
        first_step_id: int = 1,
        vocab_size: int = 0,
        max_loras: int = 0,
        kv_connector: KVConnectorScheduler | None = None,
        kv_offload: OffloadingConnectorScheduler | None = None,
        kv_events: KVEventRecorder | None = None,
        sliding_windows: tuple[int, ...] | list[int] = (0,),
    ) -> None:
        """``max_loras``: distinct LoRA adapters among the running requests (0: requests
        with an adapter are refused). ``kv_connector``: P/D (None: no KV transfer).
        ``kv_offload``: the host and disk tiers (None: none). With both, a request's blocks
        come from P/D when it was handed off, else from the tiers (vLLM's MultiConnector:
        the first connector with tokens to load takes the request). ``kv_events``: told
        what joins and leaves the prefix cache (None: KV events off).
        ``sliding_windows``: per KV cache group of the model, its window (0: full attention)."""
        self.config = scheduler_config
        self.block_size = cache_config.block_size
        self.num_blocks = num_blocks
        self.kv_cache_manager = KVCacheManager(
            num_blocks, self.block_size, cache_config.enable_prefix_caching, sliding_windows, kv_events,
            cache_config.prefix_cache_protected_fraction)
        # A lone request must always fit the pool, or preempting it could never help.
        self.max_model_len = min(max_model_len,
                                 self.kv_cache_manager.max_request_tokens(scheduler_config.max_num_batched_tokens))
        # Token ids must be below this (0: unchecked): the workers index embeddings with them.
        self.vocab_size = vocab_size
        self.max_loras = max_loras
        # Pinned adapters the workers have been sent: each holds a worker slot for good
        # (until unloaded), so it counts against max_loras whether it runs or not.
        self.pinned_loras: set[tuple[str, ...]] = set()
        self.requests: dict[str, Request] = {}
        # The last outputs of requests that finished lately, for gateways that lost them.
        self._recently_finished: OrderedDict[str, FinishedOutput] = OrderedDict()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Requests the workers hold state for; they are told when it can go.
        self._sent_to_workers: set[str] = set()
        self._finished_req_ids: set[str] = set()
        # Step ids keep rising across the schedulers one service process makes (one per
        # set of workers), so a late result of a dead set never matches a new step.
        self._step_id = first_step_id - 1
        # The first step sent resets the workers' state; an empty step is never sent, so
        # it takes neither a step id nor the reset.
        self._reset_pending = True
        self.num_preemptions = 0
        # Draft tokens a request's step may verify (0: no speculative decoding).
        speculative = scheduler_config.speculative
        self.num_speculative_tokens = speculative.num_speculative_tokens if speculative else 0
        # No drafts while more requests than this run or wait (0: no limit).
        self.disable_spec_above = speculative.disable_by_batch_size if speculative else 0
        self.spec_decode_stats = SpecDecodeStats(self.num_speculative_tokens)
        self.connector = kv_connector
        self.offload = kv_offload
        if kv_offload is not None:
            kv_offload.attach(self.kv_cache_manager)
        # P/D, prefill side: requests handed off since the service last took them, with
        # where their KV is held (``take_handoffs``).
        self._handoffs: list[tuple[Request, object]] = []

    # ------------------------------------------------------------------ intake

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise RequestRejected(f"request id {request.request_id!r} is already in use")
        if request.num_prompt_tokens == 0:
            raise RequestRejected("the prompt is empty")
        if self.vocab_size and not 0 <= min(request.all_token_ids) <= max(request.all_token_ids) < self.vocab_size:
            raise RequestRejected(f"the prompt has token ids outside the vocabulary [0, {self.vocab_size})")
        if request.lora_request is not None and not self.max_loras:
            raise RequestRejected("the request names a LoRA adapter, but this engine runs without enable_lora")
        if request.sampling_params.max_tokens < 1:
            raise RequestRejected(f"max_tokens must be >= 1, got {request.sampling_params.max_tokens}")
        if request.num_prompt_tokens >= self.max_model_len:
            raise RequestRejected(
                f"the prompt has {request.num_prompt_tokens} tokens, but this engine "
                f"accepts at most {self.max_model_len - 1} prompt tokens (max_model_len "
                f"{self.max_model_len}, KV cache {self.num_blocks} blocks of {self.block_size})"
            )
        if request.num_output_tokens and (request.num_tokens >= self.max_model_len
                                          or request.num_output_tokens >= request.sampling_params.max_tokens):
            # A resumed request that had reached its end (its last output was lost with its engine).
            raise RequestRejected(f"the request already has {request.num_output_tokens} output tokens: "
                                  f"nothing is left to generate within max_tokens and max_model_len "
                                  f"{self.max_model_len}")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    @property
    def last_step_id(self) -> int:
        return self._step_id

    def resume_requests(self, requests: list[Request]) -> list[Request]:
        """Take over the unfinished requests of an engine whose workers died: each is
        recomputed from its prompt and the tokens it already generated (as after a
        preemption, but sent to the new workers as new requests with those tokens), so
        its output continues where the client's stream stopped. Returns the requests
        this engine cannot hold (longer than its max_model_len)."""
        refused = []
        for request in requests:
            if request.num_tokens >= self.max_model_len or request.request_id in self.requests:
                refused.append(request)
                continue
            request.status = RequestStatus.WAITING
            request.num_computed_tokens = 0
            request.num_output_placeholders = 0
            request.num_draft_tokens = 0
            self.requests[request.request_id] = request
            self.waiting.append(request)
        return refused

    def abort_requests(self, request_ids) -> list[Request]:
        """Finish the named requests now, freeing their blocks. Unknown ids are ignored."""
        aborted = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, FinishReason.ABORT)
            aborted.append(request)
        return aborted

    def unpin_loras(self, names: list[str]) -> None:
        """Adapters of these names were unloaded: the workers free their pinned slots."""
        self.pinned_loras = {key for key in self.pinned_loras if key[0] not in names}

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def has_finished_to_send(self) -> bool:
        """Requests that left since the last step, which the workers still hold (the next
        step's ``finished_req_ids``)."""
        return bool(self._finished_req_ids)

    def has_connector_work(self) -> bool:
        """Loads or holds whose deadlines ``schedule()`` must check now and then."""
        return self.is_loading_remote_kv() or (self.connector is not None and bool(self.connector.holds))

    def is_loading_remote_kv(self) -> bool:
        """Requests wait for their KV (P/D pulls, loads from the tiers: the workers push the
        ends of loads; the service polls with an empty step now and then in case a push was
        lost)."""
        return ((self.connector is not None and bool(self.connector.loads))
                or (self.offload is not None and bool(self.offload.loads)))

    def has_connector_meta(self) -> bool:
        """The tiers have copies for the workers (units of a request that just ended): a step
        should go out even with no request to run."""
        return self.offload is not None and self.offload.has_meta()

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    # ------------------------------------------------------------------ schedule

    def schedule(self, allow_preemption: bool = True, poll_kv_loads: bool = False) -> SchedulerOutput:
        """The next step. ``allow_preemption=False`` while an earlier step is in flight:
        requests that need blocks the pool lacks then wait for a later step. ``poll_kv_loads``:
        a step with nothing in it is worth sending while KV loads are pending (its result
        reports ended loads whose push was lost)."""
        # Invariant: every running request holds blocks for its num_computed_tokens,
        # and every request appears at most once in running + waiting.
        if self.connector is not None or self.offload is not None:
            self._connector_deadlines()
        budget = self.config.max_num_batched_tokens
        threshold = self.config.long_prefill_token_threshold
        num_scheduled: dict[str, int] = {}
        new_blocks_of: dict[str, list[list[int]]] = {}  # per KV cache group
        num_spec_of: dict[str, int] = {}  # draft tokens among the scheduled ones
        scheduled_running: list[Request] = []
        preempted: list[Request] = []
        out_of_blocks = False

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = request.num_tokens + request.num_output_placeholders - request.num_computed_tokens
            if num_new <= 0 or (request.num_output_placeholders and self._surely_finishes(request)):
                index += 1
                continue
            if threshold:
                num_new = min(num_new, threshold)
            num_new = min(num_new, budget)
            num_spec = self._num_spec_tokens(request, num_new, budget)
            while True:
                new_blocks = self.kv_cache_manager.allocate_slots(request, num_new + num_spec)
                if new_blocks is None and num_spec:
                    num_spec = 0  # drafts are worth no preemption
                    continue
                if new_blocks is not None or not allow_preemption:
                    break
                victim = self.running.pop()  # lowest priority: the last admitted
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if new_blocks is None:
                out_of_blocks = True
                break
            scheduled_running.append(request)
            num_scheduled[request.request_id] = num_new + num_spec
            if num_spec:
                num_spec_of[request.request_id] = num_spec
            new_blocks_of[request.request_id] = [[b.block_id for b in group] for group in new_blocks]
            budget -= num_new + num_spec
            index += 1

        scheduled_new: list[Request] = []
        scheduled_resumed: list[Request] = []
        # The workers hold max_loras adapters: a request of another adapter waits until a
        # running adapter's requests are done, and the requests behind it wait too (FIFO),
        # so running adapters cannot keep taking new requests past it.
        running_loras = {r.lora_key for r in self.running if r.lora_key} | self.pinned_loras
        # P/D: requests whose prompt KV is still loading stay in line, skipped.
        skipped: deque[Request] = deque()
        # After a preemption the pool is full: admitting waiting requests would thrash.
        while (
            not preempted
            and not out_of_blocks
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[0]
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                skipped.append(self.waiting.popleft())
                continue
            if request.lora_key and request.lora_key not in running_loras:
                if len(running_loras) >= self.max_loras:
                    break
                running_loras.add(request.lora_key)
            if request.num_computed_tokens:  # P/D: its prompt's KV was loaded into its blocks
                computed_blocks, num_computed = None, request.num_computed_tokens
            else:
                computed_blocks, num_computed = self.kv_cache_manager.get_computed_blocks(request)
                loading = self._start_remote_load(request, computed_blocks, num_computed)
                if loading is None:
                    break  # no room for its blocks yet
                if loading:
                    skipped.append(self.waiting.popleft())
                    continue
            num_new = request.num_tokens - num_computed
            if threshold:
                num_new = min(num_new, threshold)
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            new_blocks = self.kv_cache_manager.allocate_slots(
                request, num_new, computed_blocks, num_computed - request.num_computed_tokens
            )
            if new_blocks is None:
                break
            self.waiting.popleft()
            self.running.append(request)
            if request.lora_request is not None and request.lora_request.pinned:
                self.pinned_loras.add(request.lora_key)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_computed
                external = self.offload.take_external_tokens(request.request_id) if self.offload is not None else 0
                self.kv_cache_manager.prefix_cache_stats.record(request.num_tokens, num_computed - external, external)
            request.num_computed_tokens = num_computed
            resumed = request.status == RequestStatus.PREEMPTED
            request.status = RequestStatus.RUNNING
            (scheduled_resumed if resumed else scheduled_new).append(request)
            num_scheduled[request.request_id] = num_new
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))

        output = self._make_output(
            scheduled_new, scheduled_resumed, scheduled_running, num_scheduled, new_blocks_of, num_spec_of,
            poll_kv_loads,
        )
        for req_id, n in num_scheduled.items():
            request = self.requests[req_id]
            request.num_computed_tokens += n
            if request.num_computed_tokens >= request.num_tokens + request.num_output_placeholders:
                request.num_output_placeholders += 1  # the step reaches its end: it samples
        return output

    # ------------------------------------------------------------------ P/D

    def _start_remote_load(self, request: Request, computed_blocks, num_computed: int) -> bool | None:
        """If the request's KV past its local prefix-cache hits lies on a prefill engine (P/D)
        or in the host or disk tier, allocate blocks for it (cached once loaded) and park the
        request until the workers have loaded it. False: it computes as any other request;
        None: the pool has no room for its blocks now."""
        connector, num_external = None, 0
        if self.connector is not None:
            num_external, _ = self.connector.get_num_new_matched_tokens(request, num_computed)
            connector = self.connector
        if not num_external and self.offload is not None:
            num_external = self.offload.get_num_new_matched_tokens(request, num_computed)
            connector = self.offload
        if not num_external:
            return False
        kv = self.kv_cache_manager
        if kv.allocate_slots(request, num_external, computed_blocks, num_computed, delay_cache_blocks=True) is None:
            return None
        request.num_computed_tokens = num_computed
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        if request.num_cached_tokens < 0 and connector is self.connector:
            request.num_cached_tokens = num_computed  # P/D: the prompt was computed elsewhere
        connector.update_state_after_alloc(request, kv.get_block_ids(request.request_id), num_computed, num_external)
        return True

    def _connector_deadlines(self) -> None:
        if self.connector is not None:
            for request in self.connector.expired_holds():
                self.kv_cache_manager.free(request)
            for request in self.connector.expired_loads():
                self._recompute_prompt(request)
        if self.offload is not None:
            for request in self.offload.expired_loads():
                self._recompute_prompt(request)

    def _recompute_prompt(self, request: Request) -> None:
        """A load failed or timed out: the request computes its prompt here instead (its
        blocks were never cached, so none of the load's partial data is ever hit)."""
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING

    def update_from_kv_loads(self, finished: list[str], failed: list[str], num_bytes: int) -> None:
        """Loads the workers finished become runnable (their blocks join the prefix cache);
        failed ones recompute. From a step's result or pushed between steps; ids of loads no
        longer waited for (reported twice, cancelled meanwhile, another connector's) are
        ignored by each connector."""
        connectors = [c for c in (self.connector, self.offload) if c is not None]
        if self.connector is not None:
            self.connector.stats.bytes += num_bytes * self.connector.world_size
        for connector in connectors:
            for load in connector.finished_loading(finished):
                request = load.request
                request.num_computed_tokens = load.num_local + load.num_external
                self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
                request.status = RequestStatus.WAITING
            for request in connector.failed_loading(failed):
                self._recompute_prompt(request)

    def _hand_off(self, request: Request) -> None:
        """Prefill side: the request's first token is out; its blocks stay held for the
        decode engine the service picks (``take_handoffs``), the workers drop its state."""
        params = None
        if self.connector is not None:
            _, params = self.connector.request_finished(request, self.kv_cache_manager.get_block_ids(request.request_id))
        request.status = RequestStatus.FINISHED
        del self.requests[request.request_id]
        if request.request_id in self._sent_to_workers:
            self._sent_to_workers.discard(request.request_id)
            self._finished_req_ids.add(request.request_id)
        self._handoffs.append((request, params))

    def take_handoffs(self) -> list[tuple[Request, object]]:
        handoffs, self._handoffs = self._handoffs, []
        return handoffs

    def release_held(self, request_ids: list[str], incarnation: str) -> int:
        """Prefill side: the decode side is done with these requests' blocks."""
        released = self.connector.release(request_ids, incarnation) if self.connector is not None else []
        for request in released:
            self.kv_cache_manager.free(request)
        return len(released)

    def decode_locally(self, request: Request) -> None:
        """Prefill side: no decode engine took the request: free its hold (its blocks stay in
        the prefix cache) and run it here, from its prompt and first token."""
        self.release_held([request.request_id], self.connector.incarnation)
        request.do_remote_decode = False
        request.status = RequestStatus.WAITING
        request.finish_reason = FinishReason.NONE
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def _num_spec_tokens(self, request: Request, num_new: int, budget: int) -> int:
        """How many of the request's drafts go into this step: none unless the step reaches
        the end of its known tokens; never past the budget, max_tokens or max_model_len
        (the step yields up to one token more than it verifies drafts)."""
        if not request.num_draft_tokens or request.num_computed_tokens + num_new < request.num_tokens:
            return 0
        if self.disable_spec_above and self.get_num_unfinished_requests() > self.disable_spec_above:
            return 0
        return max(0, min(
            request.num_draft_tokens,
            self.num_speculative_tokens,
            budget - num_new,
            request.sampling_params.max_tokens - request.num_output_tokens - 1,
            self.max_model_len - request.num_tokens - 1,
        ))

    def _surely_finishes(self, request: Request) -> bool:
        """Whether the tokens in flight end the request by length, so scheduling it
        ahead would compute past its end."""
        num_outputs = request.num_output_tokens + request.num_output_placeholders
        return (
            num_outputs >= request.sampling_params.max_tokens
            or request.num_tokens + request.num_output_placeholders >= self.max_model_len
            or (request.do_remote_decode and num_outputs >= 1)  # P/D: handed off after one token
        )

    def _make_output(
        self, scheduled_new, scheduled_resumed, scheduled_running, num_scheduled, new_blocks_of, num_spec_of,
        poll_kv_loads: bool,
    ) -> SchedulerOutput:
        kv = self.kv_cache_manager
        new_reqs = []
        for request in scheduled_new:
            new_reqs.append(
                NewRequestData(
                    req_id=request.request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    sampling_params=request.sampling_params,
                    block_ids=kv.get_group_block_ids(request.request_id),
                    num_computed_tokens=request.num_computed_tokens,
                    eos_token_id=request.eos_token_id,
                    output_token_ids=request.output_token_ids,
                    lora_request=request.lora_request,
                )
            )
            self._sent_to_workers.add(request.request_id)
        cached = CachedRequestData()
        resumed_flags = [True] * len(scheduled_resumed) + [False] * len(scheduled_running)
        for request, resumed in zip(scheduled_resumed + scheduled_running, resumed_flags):
            cached.req_ids.append(request.request_id)
            cached.resumed_from_preemption.append(resumed)
            cached.new_block_ids.append(
                kv.get_group_block_ids(request.request_id) if resumed else new_blocks_of[request.request_id]
            )
            cached.num_computed_tokens.append(request.num_computed_tokens)
        order = [r.request_id for r in scheduled_new] + cached.req_ids
        finished = sorted(self._finished_req_ids)
        self._finished_req_ids.clear()
        reset_state = False
        meta = self._connector_meta()
        if order or finished or meta is not None or (poll_kv_loads and self.is_loading_remote_kv()):
            self._step_id += 1
            reset_state, self._reset_pending = self._reset_pending, False
        return SchedulerOutput(
            step_id=self._step_id,
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            scheduled_req_ids=order,
            num_scheduled_tokens=[num_scheduled[r] for r in order],
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=finished,
            reset_state=reset_state,
            num_spec_tokens=[num_spec_of.get(r, 0) for r in order] if num_spec_of else [],
            kv_connector_metadata=meta,
        )

    def _connector_meta(self) -> KVConnectorMetadata | None:
        """Both connectors' parts of the step's metadata (None: nothing to do)."""
        meta = self.connector.build_connector_meta() if self.connector is not None else None
        if self.offload is None:
            return meta
        spills, stores, loads, cancels = self.offload.build_meta()
        if not (spills or stores or loads or cancels):
            return meta
        meta = meta or KVConnectorMetadata()
        meta.offload_spills, meta.offload_stores, meta.offload_loads = spills, stores, loads
        meta.reqs_to_cancel = meta.reqs_to_cancel + cancels
        return meta

    def step_worth_sending(self, step: SchedulerOutput, poll_kv_loads: bool = False) -> bool:
        """Whether ``step`` has anything for the workers (work, state to drop, connector
        metadata, or, with ``poll_kv_loads``, loads whose end its result may report)."""
        return bool(step.total_num_scheduled_tokens or step.finished_req_ids or step.kv_connector_metadata
                    or (poll_kv_loads and self.is_loading_remote_kv()))

    def _preempt(self, request: Request) -> None:
        if self.offload is not None:
            self.offload.on_preempt(request, self.kv_cache_manager.req_to_blocks.get(request.request_id, []))
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0  # nothing is in flight when preempting
        request.num_draft_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        logger.debug("preempted %s", request.request_id)

    # ------------------------------------------------------------------ results

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineOutput]:
        """Append sampled tokens, finish requests that stop, and report per request."""
        outputs = []
        if self.connector is not None or self.offload is not None:
            self.update_from_kv_loads(runner_output.finished_recving, runner_output.failed_recving,
                                      runner_output.kv_bytes_recvd)
        if self.offload is not None:
            self.offload.add_counters(runner_output.kv_offload)
        num_reqs = len(runner_output.req_ids)
        if runner_output.token_logprobs:
            logprobs = runner_output.token_logprobs
        else:
            logprobs = [[lp] if lp else [] for lp in runner_output.logprobs or [None] * num_reqs]
        num_drafts = runner_output.num_draft_tokens or [0] * num_reqs
        num_spec_of = dict(zip(scheduler_output.scheduled_req_ids, scheduler_output.num_spec_tokens))
        for req_id, chunk in zip(runner_output.req_ids, runner_output.prompt_logprobs):
            request = self.requests.get(req_id)
            if chunk is not None and request is not None:
                request.add_prompt_logprobs(chunk)
        for req_id, token_ids, lps, num_proposed in zip(
            runner_output.req_ids, runner_output.sampled_token_ids, logprobs, num_drafts
        ):
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING or not token_ids:
                continue  # finished or aborted meanwhile, or a prompt chunk that samples nothing
            request.num_draft_tokens = num_proposed
            num_spec = num_spec_of.get(req_id, 0)
            if num_spec:
                self._rollback_rejected(request, num_spec, num_accepted=len(token_ids) - 1)
            # Stops are checked token by token: an accepted run is cut exactly at its stop.
            new_token_ids = []
            for token_id in token_ids:
                request.num_output_placeholders = max(request.num_output_placeholders - 1, 0)
                request.append_output_token(token_id)
                new_token_ids.append(token_id)
                reason = self._check_stop(request)
                if reason != FinishReason.NONE:
                    self.running.remove(request)
                    self._finish(request, reason)
                    break
            if request.do_remote_decode and not request.is_finished:
                self.running.remove(request)
                self._hand_off(request)
            output = self._engine_output(request, new_token_ids, lps[: len(new_token_ids)])
            output.prompt_logprobs = request.take_prompt_logprobs()
            outputs.append(output)
        if self.kv_cache_manager.has_sliding_window:
            # The step is done: blocks that fell out of a window go back now, not at the
            # request's next allocation (a later step of it reads only from its window on).
            for req_id in scheduler_output.scheduled_req_ids:
                request = self.requests.get(req_id)
                if request is not None and request.status == RequestStatus.RUNNING:
                    self.kv_cache_manager.remove_skipped_blocks(request)
        return outputs

    def _rollback_rejected(self, request: Request, num_spec: int, num_accepted: int) -> None:
        """The step computed ``num_spec`` draft positions, of which the first
        ``num_accepted`` were accepted: the rejected ones are not computed after all, and
        blocks that held only them go back to the pool."""
        if not 0 <= num_accepted <= num_spec:
            raise ValueError(f"{request.request_id}: {num_accepted + 1} tokens back for {num_spec} drafts")
        self.spec_decode_stats.record(num_spec, num_accepted)
        request.num_computed_tokens -= num_spec - num_accepted
        self.kv_cache_manager.free_tail(request)

    def _check_stop(self, request: Request) -> FinishReason:
        params = request.sampling_params
        last = request.all_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last == request.eos_token_id:
                return FinishReason.STOP
            if last in params.stop_token_ids:
                request.stop_reason = last  # vLLM: the stop token id; EOS leaves it None
                return FinishReason.STOP
        if request.num_output_tokens >= params.max_tokens:
            return FinishReason.LENGTH
        if request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return FinishReason.NONE

    def _finish(self, request: Request, reason: FinishReason) -> None:
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if self.connector is not None:
            self.connector.request_finished(request, [])  # a load under way is cancelled
        if self.offload is not None:
            self.offload.request_finished(request)
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        end = self._engine_output(request, [], [], carry_stop=True)
        self._remember_output(FinishedOutput(end, request.output_token_ids))
        if request.request_id in self._sent_to_workers:
            self._sent_to_workers.discard(request.request_id)
            self._finished_req_ids.add(request.request_id)

    def _remember_output(self, finished: FinishedOutput) -> None:
        self._recently_finished[finished.end.request_id] = finished
        if len(self._recently_finished) > RECENTLY_FINISHED:
            self._recently_finished.popitem(last=False)

    def take_finished_outputs(self, previous: "Scheduler") -> None:
        """What ``previous`` (the scheduler this one replaces) remembered of its finished
        requests: a gateway that lost one's last output can still ask for it."""
        self._recently_finished = previous._recently_finished

    def remember_handoff(self, request: Request, owner_engine_id: str, owner_incarnation: str) -> None:
        """Prefill side: a decode engine took the request. Resends of its output are answered
        as a finished request's, naming the new owner: a gateway that lost the output naming
        it (its detokenizer died) learns the owner and watches it, instead of waiting on an
        engine that no longer knows the request."""
        output = self._engine_output(request, [], [], carry_stop=True)
        output.owner_engine_id, output.owner_incarnation = owner_engine_id, owner_incarnation
        self._remember_output(FinishedOutput(output, list(request.output_token_ids)))

    def resend_output(self, request_id: str, token_offset: int) -> EngineOutput | None:
        """The output of a request from ``token_offset`` on, as one output (without
        logprobs), for a gateway whose stream lost it (a detokenizer died with it). A
        request that finished recently is answered too, so a lost last delta (its end)
        is recovered. None if the request is unknown here (another engine's, or long
        finished) or nothing lies behind the offset."""
        request = self.requests.get(request_id)
        if request is not None:
            if not 0 <= token_offset < request.num_output_tokens:
                return None
            return self._engine_output(request, request.output_token_ids[token_offset:], [], carry_stop=True)
        finished = self._recently_finished.get(request_id)
        if finished is None or not 0 <= token_offset <= len(finished.output_token_ids):
            return None
        return finished.output_from(token_offset)

    def stop_strings(self, request_id: str) -> RequestStopStrings | None:
        """The stop strings and text settings of a request running or finished lately, for
        a detokenizer that missed their broadcast; None if unknown here."""
        request = self.requests.get(request_id)
        if request is not None:
            return RequestStopStrings.of(request_id, request.sampling_params)
        finished = self._recently_finished.get(request_id)
        if finished is None:
            return None
        return finished.end.text_settings or RequestStopStrings(request_id, finished.end.stop)

    def _engine_output(self, request: Request, new_token_ids, logprobs, carry_stop: bool = False) -> EngineOutput:
        """``carry_stop``: the output carries the stop strings itself (resent outputs);
        else it only says the request has some (the detokenizers hold them)."""
        # The tokens before the new ones that a stateless detokenizer needs to finish
        # UTF-8 characters and stop strings that span tokens.
        params = request.sampling_params
        stop = params.stop
        window = window_tokens(stop)
        start = max(0, request.num_output_tokens - len(new_token_ids) - window)
        return EngineOutput(
            request_id=request.request_id,
            gateway_id=request.gateway_id,
            new_token_ids=new_token_ids,
            window_token_ids=request.all_token_ids[request.num_prompt_tokens + start :],
            window_offset=start,
            num_prompt_tokens=request.num_prompt_tokens,
            finish_reason=request.finish_reason,
            logprobs=logprobs,
            stop=stop if carry_stop else [],
            # A resumed request may hit its own earlier outputs: only prompt tokens count.
            num_cached_tokens=min(max(request.num_cached_tokens, 0), request.num_prompt_tokens),
            has_stop=params.has_text_settings and not carry_stop,
            stop_reason=request.stop_reason,
            text_settings=RequestStopStrings.of(request.request_id, params)
            if carry_stop and params.has_text_settings else None,
            owner_engine_id=self.connector.engine_id if request.came_by_handoff else "",
            owner_incarnation=self.connector.incarnation if request.came_by_handoff else "",
        )

    # ------------------------------------------------------------------ stats

    def stats(self) -> dict:
        kv = self.kv_cache_manager
        return {
            "num_requests_running": len(self.running),
            "num_requests_waiting": len(self.waiting),
            "kv_cache_usage_perc": kv.usage(),
            "prefix_cache_queries": kv.prefix_cache_stats.queries,
            "prefix_cache_hits": kv.prefix_cache_stats.hits,
            "num_preemptions": self.num_preemptions,
            **kv.prefix_cache_stats.by_source(),
            **(self.offload.engine_stats() if self.offload is not None else {}),
            "block_size": self.block_size,
            "num_gpu_blocks": self.num_blocks,
            "num_prefill_tokens_pending": self.num_prefill_tokens_pending(),
            **self.spec_decode_stats.as_engine_stats(),
            **self._kv_transfer_stats(),
            **self._lora_stats(),
        }

    def num_prefill_tokens_pending(self) -> int:
        """Prompt tokens (and, for resumed or preempted requests, known output tokens) the
        waiting and running requests have yet to compute, past what a waiting request would
        find in the prefix cache now: a router's measure of the prefill work queued here."""
        pending = 0
        for request in self.waiting:
            num_hit = 0
            if not request.num_computed_tokens:
                num_hit = self.kv_cache_manager.get_computed_blocks(request)[1]
            pending += request.num_tokens - max(request.num_computed_tokens, num_hit)
        return pending + sum(r.num_tokens - r.num_computed_tokens for r in self.running
                             if r.num_computed_tokens < r.num_tokens - 1)

    def _kv_transfer_stats(self) -> dict:
        if self.connector is None:
            return {}
        stats = self.connector.stats
        return {
            "kv_role": self.connector.config.kv_role,
            "num_requests_waiting_for_remote_kv": self.connector.num_waiting_for_remote_kv,
            "kv_transfer_bytes": stats.bytes,
            "kv_transfer_seconds": stats.seconds,
            "kv_transfer_requests": stats.requests,
            "kv_transfer_failures": stats.failures,
            "kv_transfer_fallbacks": stats.fallbacks,
        }

    def _lora_stats(self) -> dict:
        if not self.max_loras:
            return {}
        return {
            "running_lora_adapters": sorted({r.lora_key[0] for r in self.running if r.lora_key}),
            "waiting_lora_adapters": sorted({r.lora_key[0] for r in self.waiting if r.lora_key}),
            "max_lora": self.max_loras,
        }
