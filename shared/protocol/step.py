"""One engine step: the scheduler's diff to every worker rank, and rank 0's answer.

    scheduler ==SchedulerOutput==> every worker rank of the engine
              <==ModelRunnerOutput== rank 0

The hottest messages: ``array_like`` Structs of ints and lists of ints.
"""

from __future__ import annotations

import msgspec

from shared.protocol.codec import SUBJECT_PREFIX, Channel, Codec
from shared.protocol.common import Logprobs, LoRARequest, SamplingParams
from shared.protocol.kv_offload import KVOffloadCounters
from shared.protocol.kv_transfer import KVConnectorMetadata


class NewRequestData(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A request the workers have not seen: sent once, then cached on each worker."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[list[int]]  # per KV cache group (shared/kv_cache_groups.py)
    num_computed_tokens: int
    # Masked while fewer than min_tokens were generated.
    eos_token_id: int | None = None
    # Tokens already generated, for a request resumed on restarted workers: they are
    # recomputed with the prompt and count as output (penalties, min_tokens).
    output_token_ids: list[int] = []
    # Sent once with the request: each worker keeps it in the request's state.
    lora_request: LoRARequest | None = None
    # Tracing on and the request traced: the W3C traceparent of its engine span, under
    # which the workers make theirs (services/worker/request_traces.py); else "" (omitted).
    trace_context: str = ""


class CachedRequestData(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What changed for requests the workers already hold, as parallel lists.

    ``new_block_ids[i][g]`` are appended to the request's block table of KV cache
    group ``g``, unless ``resumed_from_preemption[i]``, in which case they replace it
    (the request was preempted, its blocks freed, and it is being recomputed). Before
    appending, each table is cut to the blocks its ``num_computed_tokens[i]`` fill: the
    scheduler freed those past them (they held only rejected draft tokens).
    """

    req_ids: list[str] = []
    resumed_from_preemption: list[bool] = []
    new_block_ids: list[list[list[int]]] = []
    num_computed_tokens: list[int] = []


class SchedulerOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One engine step, as a diff against what the workers already hold.

    ``num_scheduled_tokens`` is parallel to ``scheduled_req_ids`` (new requests
    first, then cached ones, in batch order). With speculative decoding,
    ``num_spec_tokens`` (parallel too, or empty when no request has any) says how many
    of a request's scheduled tokens are draft tokens: the last ones, taken from the
    drafts the workers proposed themselves after the request's previous step (they
    reported how many they hold in ``ModelRunnerOutput.num_draft_tokens``).
    """

    step_id: int
    scheduled_new_reqs: list[NewRequestData] = []
    scheduled_cached_reqs: CachedRequestData = msgspec.field(default_factory=CachedRequestData)
    scheduled_req_ids: list[str] = []
    num_scheduled_tokens: list[int] = []
    total_num_scheduled_tokens: int = 0
    finished_req_ids: list[str] = []
    # The first step of a (re)started scheduler: workers drop every cached request.
    reset_state: bool = False
    # Random per scheduler process (EngineStats.incarnation): step ids restart at 1
    # with each one, so a result is matched by (incarnation, step_id).
    incarnation: str = ""
    num_spec_tokens: list[int] = []
    # P/D (docs/ARCHITECTURE.md): what the workers' KV connector must load, serve or stop.
    kv_connector_metadata: KVConnectorMetadata | None = None


class PromptLogprobs(msgspec.Struct, array_like=True, gc=False):
    """The logprobs of prompt tokens ``start .. start + len(entries) - 1`` of one request,
    from one prefill chunk (``entries[i]``: index 0 the prompt token, then the top-n)."""

    start: int
    entries: list[Logprobs]


class ModelRunnerOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Rank 0's answer to one step. ``sampled_token_ids[i]`` is empty for a
    request whose prompt is still being prefilled in chunks.

    With speculative decoding a request's ``sampled_token_ids[i]`` are its accepted
    draft tokens and one more (the target's own); ``token_logprobs[i]`` then has one
    Logprobs per sampled token (and ``logprobs`` is empty), and ``num_draft_tokens[i]``
    is how many drafts the workers now hold for its next step (empty lists: none).
    """

    step_id: int
    req_ids: list[str] = []
    sampled_token_ids: list[list[int]] = []
    logprobs: list[Logprobs | None] = []
    error: str = ""
    # Seconds per worker phase (shared/step_profile.WORKER_PHASES), when profiling.
    timings: list[float] = []
    # The incarnation of the step this answers (SchedulerOutput.incarnation).
    incarnation: str = ""
    num_draft_tokens: list[int] = []
    token_logprobs: list[list[Logprobs]] = []
    # Parallel to req_ids, or empty: the prompt logprobs this step computed (None: none).
    prompt_logprobs: list[PromptLogprobs | None] = []
    # P/D: loads every rank finished since the last step (their blocks hold the prompt's
    # KV), loads some rank failed (the scheduler recomputes those), and the bytes rank 0
    # pulled meanwhile (each rank pulls an equal shard).
    finished_recving: list[str] = []
    failed_recving: list[str] = []
    kv_bytes_recvd: int = 0
    # The tiered KV cache's traffic since rank 0's last report (None: no offloading).
    kv_offload: KVOffloadCounters | None = None


SCHEDULER_OUTPUT = Codec(SchedulerOutput)
MODEL_RUNNER_OUTPUT = Codec(ModelRunnerOutput)

# Every worker rank of engine ``{}`` receives each step diff here.
STEP_CHANNEL = Channel(f"{SUBJECT_PREFIX}.engine.{{}}.step", SCHEDULER_OUTPUT)
# Rank 0 answers each step here.
STEP_RESULT_CHANNEL = Channel(f"{SUBJECT_PREFIX}.engine.{{}}.result", MODEL_RUNNER_OUTPUT)

engine_step_subject = STEP_CHANNEL.subject
engine_result_subject = STEP_RESULT_CHANNEL.subject
