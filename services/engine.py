"""The in-process engine: scheduler and one worker wired in a single process.

For scripts, tests and offline batch use. The parts still talk only through the
protocol messages, and every step message makes a msgpack round trip, exactly as
it would on the bus, so nothing unserializable can slip in. Requests are checked
and prepared as the tokenizer service prepares them (``shared.request_preparation``).
"""

from __future__ import annotations

import itertools
import time
import uuid

import msgspec
from dataclasses import dataclass, field

from services.scheduler.kv_offload.connector import OffloadingConnectorScheduler
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from services.worker.forward_activity import ForwardActivity
from services.worker.kv_offload.build import build_offloading_worker
from services.worker.kv_transfer.load_reports import LoadReports
from services.worker.model_runner import ModelRunner
from shared.config import CacheConfig, KVOffloadConfig, LoRAConfig, ModelRunConfig, SchedulerConfig
from shared.protocol import (
    MODEL_RUNNER_OUTPUT,
    SCHEDULER_OUTPUT,
    EngineOutput,
    EngineRequest,
    FinishReason,
    Logprobs,
    LoRARequest,
    SamplingParams,
    TokenizeRequest,
)
from shared.request_preparation import RequestPreparer
from shared.step_profile import NULL_CLOCK


@dataclass
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprobs] = field(default_factory=list)
    finish_reason: FinishReason = FinishReason.NONE
    num_cached_tokens: int = 0
    text: str = ""


class Engine:
    def __init__(
        self,
        run_config: ModelRunConfig = ModelRunConfig(),
        cache_config: CacheConfig = CacheConfig(),
        scheduler_config: SchedulerConfig = SchedulerConfig(),
        worker: ModelRunner | None = None,
        lora_config: LoRAConfig = LoRAConfig(),
        kv_offload_config: KVOffloadConfig = KVOffloadConfig(),
    ) -> None:
        """``worker``: an already loaded runner to reuse (tests share one model);
        it must hold no request state (every engine that used it has finished).
        ``kv_offload_config``: the host and disk KV tiers (both connector roles in process)."""
        self.worker = worker or ModelRunner(run_config, cache_config, scheduler_config, lora_config=lora_config)
        if worker is not None:
            worker.use_speculative(scheduler_config.speculative)
            if lora_config.enable_lora:
                worker.use_lora(lora_config)
        self.offload_worker = None
        self.forward_activity = ForwardActivity()  # steps run on the caller's thread
        self._load_reports = LoadReports(None, "0", 0, 1)
        kv_offload = None
        if kv_offload_config.enabled:
            kv_offload_config.check_speculative(scheduler_config.speculative)
            self.offload_worker, namespace = build_offloading_worker(
                self.worker, kv_offload_config, self._load_reports, activity=self.forward_activity)
            kv_offload = OffloadingConnectorScheduler(kv_offload_config, cache_config.block_size,
                                                      [self.offload_worker.info(namespace)],
                                                      cache_config.enable_prefix_caching)
        self.scheduler = Scheduler(
            scheduler_config, cache_config, self.worker.num_blocks, self.worker.max_model_len,
            max_loras=lora_config.max_loras if lora_config.enable_lora else 0, kv_offload=kv_offload,
            sliding_windows=self.worker.kv_sliding_windows,
        )
        self.cache_config = cache_config
        self.model_config = self.worker.model_config
        self.preparer = RequestPreparer(
            self.worker.max_model_len, self.model_config.vocab_size, tuple(self.model_config.eos_token_ids)
        )
        self._tokenizer = None
        self._ids = itertools.count()
        self._id_prefix = uuid.uuid4().hex[:8]

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from shared.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self.worker.model_path)
        return self._tokenizer

    def add_request(
        self, prompt_token_ids: list[int], sampling_params: SamplingParams, request_id: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Queue a prompt (under ``lora_request``'s adapter, if any); raises ``InvalidRequest``
        where the tokenizer service would refuse it."""
        request = self._prepare(prompt_token_ids, sampling_params, request_id, lora_request)
        self._schedule(request)
        return request.request_id

    def _prepare(
        self, prompt: str | list[int], sampling_params: SamplingParams, request_id: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> EngineRequest:
        """The request as the tokenizer service would hand it to a scheduler."""
        prompt_field = {"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": list(prompt)}
        request = TokenizeRequest(
            request_ids=[request_id or f"{self._id_prefix}-{next(self._ids)}"],
            gateway_id="",
            sampling_params=sampling_params,
            **prompt_field,
        )
        needs_tokenizer = (isinstance(prompt, str) or sampling_params.structured_outputs is not None
                           or bool(sampling_params.bad_words))
        [engine_request] = self.preparer.prepare(request, self.tokenizer if needs_tokenizer else None)
        if lora_request is not None:
            engine_request = msgspec.structs.replace(engine_request, lora_request=lora_request)
        return engine_request

    def _schedule(self, request: EngineRequest) -> None:
        self.scheduler.add_request(Request.from_engine_request(request, self.cache_config.block_size))

    def abort(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self, clock=NULL_CLOCK) -> list[EngineOutput]:
        """One engine step; ``clock`` (a ``shared.step_profile.PhaseClock``) times its phases,
        the worker's included, when profiling."""
        scheduler_output = self.scheduler.schedule()
        clock.lap("schedule")
        scheduler_output = SCHEDULER_OUTPUT.decode(SCHEDULER_OUTPUT.encode(scheduler_output))
        clock.lap("step_message")
        offload = self.offload_worker
        self.forward_activity.step_queued()
        try:
            if offload is not None:
                self._load_reports.step_started(scheduler_output.incarnation, scheduler_output.reset_state)
                stores = offload.apply(scheduler_output.reset_state, scheduler_output.kv_connector_metadata)
                if stores is not None:
                    stores.run()
            runner_output = self.worker.execute_model(scheduler_output, clock)
        finally:
            self.forward_activity.step_ended()
        if offload is not None:
            runner_output.finished_recving, runner_output.failed_recving, _ = self._load_reports.take_finished()
            runner_output.kv_offload = offload.take_counters()
            if not scheduler_output.total_num_scheduled_tokens and self.scheduler.is_loading_remote_kv():
                time.sleep(0.001)  # only loads pending: let the copy threads run
        runner_output = MODEL_RUNNER_OUTPUT.decode(MODEL_RUNNER_OUTPUT.encode(runner_output))
        clock.lap("result_message")
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        clock.lap("update")
        return outputs

    def flush(self) -> None:
        """Tell the worker about requests that finished in the last step, so it holds
        no state once nothing is running."""
        if not self.scheduler.has_unfinished_requests():
            self.step()

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] = SamplingParams(),
        lora_requests: LoRARequest | None | list[LoRARequest | None] = None,
    ) -> list[GenerationResult]:
        """Run prompts (text or token ids) to completion, results in prompt order; each
        under its ``lora_requests`` adapter (one for all, or one per prompt; None: the base)."""
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if not isinstance(lora_requests, list):
            lora_requests = [lora_requests] * len(prompts)
        # Every prompt is checked before any is queued: a refusal leaves nothing running.
        requests = [self._prepare(p, sp, lora_request=lora)
                    for p, sp, lora in zip(prompts, sampling_params, lora_requests)]
        results: dict[str, GenerationResult] = {}
        order = []
        for request in requests:
            self._schedule(request)
            results[request.request_id] = GenerationResult(request.request_id, request.prompt_token_ids)
            order.append(request.request_id)
        pending = set(order)
        while pending:
            for out in self.step():
                result = results.get(out.request_id)
                if result is None:
                    continue
                result.token_ids.extend(out.new_token_ids)
                result.logprobs.extend(out.logprobs)
                result.num_cached_tokens = out.num_cached_tokens
                if out.finish_reason != FinishReason.NONE:
                    result.finish_reason = out.finish_reason
                    pending.discard(out.request_id)
        self.flush()
        if any(isinstance(p, str) for p in prompts):
            for result in results.values():
                result.text = self.tokenizer.decode(result.token_ids)
        return [results[r] for r in order]
