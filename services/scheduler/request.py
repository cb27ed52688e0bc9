"""The scheduler's view of one request: its tokens, progress and status."""

from __future__ import annotations

import enum

from shared.protocol import (
    EngineRequest,
    FinishReason,
    KVTransferParams,
    Logprobs,
    LoRARequest,
    PromptLogprobs,
    SamplingParams,
)

from .block_hash import extend_block_hashes, lora_hash_key


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3
    # P/D, decode side: blocks allocated, the workers are pulling the prompt's KV.
    WAITING_FOR_REMOTE_KVS = 4


class Request:
    """``num_tokens`` = prompt + output; ``num_computed_tokens`` of them have KV."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float = 0.0,
        block_size: int = 16,
        cache_salt: str = "",
        gateway_id: str = "",
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = arrival_time
        self.cache_salt = cache_salt
        self.gateway_id = gateway_id
        self.lora_request = lora_request
        self.lora_key = lora_hash_key(lora_request)
        self.block_size = block_size
        self.all_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens that steps already sent to the workers will sample, not yet reported
        # (at most one per step in flight; see Scheduler.schedule).
        self.num_output_placeholders = 0
        # Draft tokens the workers proposed for its next step (speculative decoding): they
        # hold the ids, the scheduler only how many it may schedule.
        self.num_draft_tokens = 0
        # Tokens found in the prefix cache when the request was first scheduled.
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        self.num_resumes = 0  # engine failures survived (the scheduler service resumes it)
        self.status = RequestStatus.WAITING
        self.finish_reason = FinishReason.NONE
        self.stop_reason: int | None = None  # the stop token id that ended it
        # Prompt logprobs (when asked for): one entry per prompt token, gathered over the
        # prefill chunks (a recomputed chunk adds nothing), sent with the first output.
        self.prompt_logprobs: list[Logprobs] = []
        self.prompt_logprobs_sent = False
        # P/D (services/scheduler/kv_connector.py). Prefill side: the request is handed to
        # a decode engine after its first token. Decode side: where its prompt's KV lies
        # (until loaded), and that it came by hand-off (its outputs name this engine).
        self.do_remote_decode = False
        self.kv_transfer_params: KVTransferParams | None = None
        self.came_by_handoff = False
        self.block_hashes: list[bytes] = []
        extend_block_hashes(self.block_hashes, self.all_token_ids, block_size, cache_salt, self.lora_key)

    def add_prompt_logprobs(self, chunk: PromptLogprobs) -> None:
        """A prefill chunk's prompt logprobs (tokens ``chunk.start ..``): kept where they
        continue those gathered so far; a chunk computed again (after a preemption) adds
        only what is new."""
        self._start_prompt_logprobs()
        skip = len(self.prompt_logprobs) - chunk.start
        if 0 <= skip < len(chunk.entries):
            self.prompt_logprobs.extend(chunk.entries[skip:])

    def take_prompt_logprobs(self) -> list[Logprobs]:
        """The prompt logprobs, once (with the first output)."""
        if self.prompt_logprobs_sent or self.sampling_params.prompt_logprobs is None:
            return []
        self.prompt_logprobs_sent = True
        self._start_prompt_logprobs()
        return self.prompt_logprobs

    def _start_prompt_logprobs(self) -> None:
        if not self.prompt_logprobs:
            # The first token: nothing predicts it, no logprob (vLLM's null entry).
            self.prompt_logprobs.append(Logprobs([self.prompt_token_ids[0]], [], 0))

    @classmethod
    def from_engine_request(cls, req: EngineRequest, block_size: int) -> "Request":
        """A request as it arrives; a resumed one (its engine was lost) with the output
        tokens its client already has, computed again from the prompt on."""
        request = cls(
            req.request_id,
            req.prompt_token_ids,
            req.sampling_params,
            eos_token_id=req.eos_token_id,
            arrival_time=req.arrival_time,
            block_size=block_size,
            cache_salt=req.cache_salt,
            gateway_id=req.gateway_id,
            lora_request=req.lora_request,
        )
        request.append_output_tokens(req.output_token_ids)
        return request

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        if len(self.all_token_ids) % self.block_size == 0:
            extend_block_hashes(self.block_hashes, self.all_token_ids, self.block_size, self.cache_salt,
                                self.lora_key)

    def append_output_tokens(self, token_ids: list[int]) -> None:
        """Tokens generated before this engine had the request (a hand-off, a resume):
        their prompt logprobs, if asked for, went with the first of them."""
        for token_id in token_ids:
            self.append_output_token(token_id)
        if token_ids:
            self.prompt_logprobs_sent = True

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )
