"""Every message that crosses a process boundary, and every bus subject name.

The request's way (see docs/ARCHITECTURE.md):

    gateway -> tokenizer -> scheduler ==SchedulerOutput==> workers
                                      <==ModelRunnerOutput== (rank 0)
    scheduler -> detokenizer -> gateway (EngineOutput / TextDelta)
    scheduler -> every detokenizer (StopStrings, once per request)

Hot per-step messages are ``array_like`` Structs of ints and lists of ints, encoded
with msgpack; one Encoder/Decoder per type, made once. No tensors, no pickles.
Fields of ``array_like`` Structs are only ever appended, with defaults (schema
evolution keeps old peers readable).
"""

from __future__ import annotations

import enum

import msgspec

# --------------------------------------------------------------------------- subjects

SUBJECT_PREFIX = "llm"
TOKENIZE = f"{SUBJECT_PREFIX}.tokenize"
DETOKENIZE = f"{SUBJECT_PREFIX}.detokenize"
# Schedulers broadcast their requests' stop strings to every detokenizer replica (no queue group).
DETOKENIZE_STOPS = f"{DETOKENIZE}.stops"
ENGINE_REQUESTS = f"{SUBJECT_PREFIX}.engine.requests"
# Aborts and resend requests travel per gateway (``engine_abort_subject``...): only a
# gateway may publish on its own, and schedulers obey them only for its own requests.
# Outside llm.engine.*: a gateway id must never make a subject like llm.engine.<id>.step.
ENGINE_ABORT = f"{SUBJECT_PREFIX}.abort"
ENGINE_STATS = f"{SUBJECT_PREFIX}.engine.stats"
# Gateways ask for the outputs of a stream's gap again (a detokenizer died with them).
ENGINE_RESEND = f"{SUBJECT_PREFIX}.resend"
PING = f"{SUBJECT_PREFIX}.ping"
# The gateway's /tokenize and /detokenize (request/reply, tokenizer queue group).
TOKENIZER_TOKENIZE = f"{SUBJECT_PREFIX}.tokenizer.tokenize"
TOKENIZER_DETOKENIZE = f"{SUBJECT_PREFIX}.tokenizer.detokenize"
# The launcher publishes how often it restarted each service (gateways show it in /metrics).
SERVICE_RESTARTS = f"{SUBJECT_PREFIX}.launcher.restarts"
# LoRA adapters loaded / unloaded at runtime: a gateway broadcasts each change to every
# gateway (their registries) and worker (which reads a loaded adapter ahead); a starting
# gateway asks the others for their adapters (request/reply).
LORA_ADAPTERS = f"{SUBJECT_PREFIX}.lora.adapters"
LORA_LIST = f"{SUBJECT_PREFIX}.lora.list"


def ping_subject(service: str) -> str:
    """Every replica of a service answers health pings here (queue group)."""
    return f"{PING}.{service}"


def engine_step_subject(engine_id: str) -> str:
    """Every worker rank of an engine receives each step diff here."""
    return f"{SUBJECT_PREFIX}.engine.{engine_id}.step"


def engine_result_subject(engine_id: str) -> str:
    """Rank 0 answers each step here; workers also report readiness here."""
    return f"{SUBJECT_PREFIX}.engine.{engine_id}.result"


def engine_stops_subject(engine_id: str) -> str:
    """A detokenizer asks the engine's scheduler for stop strings it missed (request/reply)."""
    return f"{SUBJECT_PREFIX}.engine.{engine_id}.stops"


def engine_profile_subject(engine_id: str) -> str:
    """The scheduler answers with its step profile summary (JSON) when profiling."""
    return f"{SUBJECT_PREFIX}.engine.{engine_id}.profile"


def engine_ready_subject(engine_id: str) -> str:
    """Workers announce themselves here (and answer the scheduler's hello)."""
    return f"{SUBJECT_PREFIX}.engine.{engine_id}.ready"


def engine_hello_subject(engine_id: str) -> str:
    """The scheduler asks every worker rank of its engine to announce itself."""
    return f"{SUBJECT_PREFIX}.engine.{engine_id}.hello"


def engine_retire_subject(engine_id: str) -> str:
    """The scheduler tells the ranks of a failed TP group to exit (and be restarted)."""
    return f"{SUBJECT_PREFIX}.engine.{engine_id}.retire"


def engine_kv_handoff_subject(engine_id: str) -> str:
    """P/D: a prefill engine's scheduler hands a prefilled request to this decode engine's
    scheduler (request/reply, ``KVHandoff``)."""
    return f"{SUBJECT_PREFIX}.engine.{engine_id}.kv.handoff"


def engine_kv_release_subject(engine_id: str) -> str:
    """P/D: a decode engine's scheduler tells this prefill engine's scheduler that it may
    free a request's held blocks (``KVRelease``, no reply)."""
    return f"{SUBJECT_PREFIX}.engine.{engine_id}.kv.release"


def engine_kv_pull_subject(engine_id: str, rank: int | str) -> str:
    """P/D: a decode worker rank asks prefill worker rank ``rank`` of this engine for a chunk
    of a held request's KV blocks (request/reply, ``KVPull`` -> ``KVChunk``)."""
    return f"{SUBJECT_PREFIX}.engine.{engine_id}.kv.pull.{rank}"


def engine_kv_serve_subject(engine_id: str) -> str:
    """P/D: a prefill engine's scheduler tells every worker rank at once which held requests
    they may serve (``KVConnectorMetadata`` with ``reqs_to_send`` only), not waiting for the
    next step to reach them behind a long prefill; the step carries it too."""
    return f"{SUBJECT_PREFIX}.engine.{engine_id}.kv.serve"


def engine_kv_recvd_subject(engine_id: str) -> str:
    """P/D under TP: a decode worker rank tells rank 0 of its engine which loads it ended
    (``KVRecvDone``); rank 0 reports a load once every rank ended it."""
    return f"{SUBJECT_PREFIX}.engine.{engine_id}.kv.recvd"


def engine_kv_loaded_subject(engine_id: str) -> str:
    """P/D: rank 0 of a decode engine tells its scheduler at once that loads ended while no
    step was running (``KVLoadsDone``), so the scheduler need not send steps to learn it."""
    return f"{SUBJECT_PREFIX}.engine.{engine_id}.kv.loaded"


def gateway_stream_subject(gateway_id: str) -> str:
    """Text deltas for the requests one gateway replica owns."""
    return f"{SUBJECT_PREFIX}.stream.{gateway_id}"


def engine_abort_subject(gateway_id: str) -> str:
    """Aborts of gateway ``gateway_id``'s requests (by it, or by a detokenizer for a stop
    string); every scheduler listens on ``engine_abort_subject("*")``."""
    return f"{ENGINE_ABORT}.{gateway_id}"


def engine_resend_subject(gateway_id: str) -> str:
    """Gateway ``gateway_id`` asks for its requests' lost outputs again."""
    return f"{ENGINE_RESEND}.{gateway_id}"


def subject_gateway_id(subject: str) -> str:
    """The gateway id a per-gateway subject ends with."""
    return subject.rsplit(".", 1)[-1]


# --------------------------------------------------------------------------- requests


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True, frozen=True):
    """A request's output constraint, vLLM's ``StructuredOutputsParams``: exactly one
    field is set. The gateway writes each in its canonical form (the JSON schema and
    the structural tag as compact JSON text, keys in the order given), which is also
    the grammar cache's key (``shared.structured_output.GrammarSpec``)."""

    json: str | None = None  # a JSON schema
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (GBNF)
    structural_tag: str | None = None


class SamplingParams(msgspec.Struct, omit_defaults=True, frozen=True):
    """Per-request sampling and stopping settings (OpenAI / vLLM meaning).

    ``top_k`` <= 0 and ``top_p`` == 1 disable those filters. ``logprobs`` is the
    number of top alternatives to return besides the sampled token (None: no
    logprobs at all). ``stop`` strings are handled by the detokenizer only.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = []
    stop: list[str] = []
    ignore_eos: bool = False
    logprobs: int | None = None
    # Sent to the workers once, with the request's new-request data; each rank compiles
    # it and keeps a grammar matcher in its request state (docs/ARCHITECTURE.md).
    structured_outputs: StructuredOutputsParams | None = None
    # Logit controls (services/worker/logit_controls.py): a bias added to a token's logit,
    # the only tokens allowed, and words never to generate (their token sequences, filled
    # in by the tokenizer service).
    logit_bias: dict[int, float] = {}
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = []
    bad_words_token_ids: list[list[int]] = []
    # Output text settings, the detokenizers' (they reach every replica with the stop
    # strings, ``RequestStopStrings``): keep a matched stop string (and the text of a stop
    # token) in the text; keep special tokens' text; vLLM's spacing between special tokens.
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Keep only the prompt's last k tokens (-1: max_model_len); the tokenizer applies it.
    truncate_prompt_tokens: int | None = None
    # Logprobs of each prompt token (and the top-n at its position), vLLM's
    # ``prompt_logprobs``: computed by the workers over every prefill chunk.
    prompt_logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_text_settings(self) -> bool:
        """Whether the detokenizers must be told anything about this request (stop strings
        or an output text setting other than the default)."""
        return bool(self.stop) or self.include_stop_str_in_output or not self.skip_special_tokens \
            or not self.spaces_between_special_tokens

    def for_choice(self, i: int) -> "SamplingParams":
        """The settings of sample ``i`` of a prompt's ``n`` (vLLM's rule): a given seed
        becomes ``seed + i``, so the samples differ from each other yet repeat from call
        to call."""
        if self.seed is None or i == 0:
            return self
        return msgspec.structs.replace(self, seed=self.seed + i)


class LoRARequest(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """The LoRA adapter a request runs under (vLLM's name): the workers read it from
    ``lora_path`` (a PEFT folder or a GGUF LoRA file) the first time they meet it;
    ``lora_name`` is the model name clients use. Requests without one run on the base model."""

    lora_name: str
    lora_path: str
    # Pinned (``"pinned": true`` on load, or a pinned ``--lora-modules`` entry): once a
    # worker puts it in a slot it stays there, and the scheduler counts that slot as taken.
    pinned: bool = False
    # The model card's ``parent`` (vLLM's ``base_model_name``; "": the served model).
    base_model_name: str = ""


class EngineRequest(msgspec.Struct, omit_defaults=True):
    """A tokenized request as the scheduler receives it."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    eos_token_id: int | None = None
    # Where outputs go: the detokenizer forwards text to this gateway's subject.
    gateway_id: str = ""
    cache_salt: str = ""
    lora_request: LoRARequest | None = None


class AbortRequest(msgspec.Struct, omit_defaults=True):
    """-> schedulers on ``engine_abort_subject(gateway_id)``: end these requests of that
    gateway (ids of another gateway's requests are ignored)."""

    request_ids: list[str]


class ResendOutputs(msgspec.Struct, omit_defaults=True):
    """gateway -> schedulers on ``engine_resend_subject(gateway_id)``: publish request
    ``request_id``'s output tokens from ``token_offset`` on to the detokenizers again (the
    ones there were lost); only for a request of that gateway."""

    request_id: str
    token_offset: int


# --------------------------------------------------------------------------- the step diff


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


class KVRecvSpec(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """P/D, decode side: one request whose prompt KV the workers pull into ``block_ids``
    (the local blocks to fill, in order): blocks ``first_block ..`` of the request held by
    engine ``remote_engine_id`` (its scheduler incarnation ``remote_incarnation``); each
    rank pulls its own shard from the same rank there."""

    req_id: str
    block_ids: list[int]
    first_block: int
    remote_engine_id: str
    remote_incarnation: str


class KVSendSpec(msgspec.Struct, array_like=True, gc=False):
    """P/D, prefill side: a finished request whose blocks the workers may serve to the
    decode side until told to stop (``KVConnectorMetadata.reqs_not_to_send``)."""

    req_id: str
    block_ids: list[int]


class KVConnectorMetadata(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The scheduler's connector role -> the workers' (vLLM's ``KVConnectorMetadata``),
    carried by the step diff. Workers apply it before the step's forward pass, in this
    order: stop serving, cancel loads, start serving, start loads."""

    reqs_to_recv: list[KVRecvSpec] = []
    reqs_to_send: list[KVSendSpec] = []
    # Released or timed out: the blocks are free again, never serve them after this step.
    reqs_not_to_send: list[str] = []
    # Loads given up (timed out, aborted): never write into their blocks after this step.
    reqs_to_cancel: list[str] = []

    def is_empty(self) -> bool:
        return not (self.reqs_to_recv or self.reqs_to_send or self.reqs_not_to_send or self.reqs_to_cancel)


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


class Logprobs(msgspec.Struct, array_like=True, gc=False):
    """Logprobs of one sampled position: index 0 is the sampled token, then top-n."""

    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int


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


# --------------------------------------------------------------------------- outputs


class FinishReason(enum.IntEnum):
    NONE = 0
    STOP = 1  # EOS, a stop token id, or a stop string
    LENGTH = 2  # max_tokens or max_model_len
    ABORT = 3
    ERROR = 4

    def openai_name(self) -> str | None:
        return {1: "stop", 2: "length", 3: "abort", 4: "error"}.get(int(self))


class EngineOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """New tokens of one request after one step, scheduler -> detokenizer.

    Carries the request's recent token window (``window_token_ids`` ends with the
    new tokens; ``window_offset`` is the index of its first token in the output)
    so that any stateless detokenizer replica can produce the next text delta.

    A request's stop strings and output text settings (``RequestStopStrings``) do not
    travel with its step outputs: ``has_stop`` says it has some that the output does not
    carry, and the detokenizers know them from the scheduler's broadcast (``StopStrings``
    on ``llm.detokenize.stops``) or ask for them (``engine_stops_subject``). ``stop`` and
    ``text_settings`` carry them only in outputs sent again (``ResendOutputs``): those
    must not depend on a replica's cache.
    """

    request_id: str
    gateway_id: str
    new_token_ids: list[int]
    window_token_ids: list[int]
    window_offset: int
    num_prompt_tokens: int
    finish_reason: FinishReason = FinishReason.NONE
    logprobs: list[Logprobs] = []
    stop: list[str] = []
    num_cached_tokens: int = 0
    error: str = ""
    has_stop: bool = False
    # The stop token id that ended the request (vLLM's ``stop_reason``); None for EOS,
    # length, or a request still running.
    stop_reason: int | None = None
    # Outputs sent again carry the request's stop strings and text settings themselves.
    text_settings: "RequestStopStrings | None" = None
    # With the first output token, when asked for: one entry per prompt token; the first
    # has the prompt's first token and no logprob (nothing predicts it).
    prompt_logprobs: list[Logprobs] = []
    # P/D: the engine now holding the request (it was handed from a prefill engine to this
    # decode engine): the gateway watches this one from now on.
    owner_engine_id: str = ""
    owner_incarnation: str = ""


# --------------------------------------------------------------------------- service messages


class ErrorInfo(msgspec.Struct, omit_defaults=True):
    """An error for the client, in OpenAI's shape plus the HTTP status to use."""

    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    status: int = 400


class EngineRequestReply(msgspec.Struct, omit_defaults=True):
    """scheduler -> tokenizer: the request was queued, or why not."""

    request_id: str
    error: ErrorInfo | None = None
    engine_id: str = ""
    # Random per scheduler process: a restarted scheduler has a new one (EngineStats too).
    incarnation: str = ""


class TokenizeRequest(msgspec.Struct, omit_defaults=True, kw_only=True):
    """gateway -> tokenizer (request/reply): one prompt and its ``n`` samples.

    Exactly one of messages / prompt / prompt_token_ids is set. The tokenizer
    validates, renders and tokenizes the prompt once, then forwards one
    ``EngineRequest`` per sample to a scheduler: ``request_ids[i]`` with
    ``sampling_params.for_choice(i)`` (seed + i). It replies with a ``TokenizeReply``.
    Sending it again (a retry after a timeout) is harmless: a scheduler takes a known
    request id as queued."""

    request_ids: list[str]
    gateway_id: str
    model: str = ""
    messages: list[dict] | None = None  # [{"role": ..., "content": str}]
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    sampling_params: SamplingParams = SamplingParams()
    add_generation_prompt: bool = True
    cache_salt: str = ""
    # Chat only: the request's tools (OpenAI's {"type": "function", "function": {...}}
    # objects) and chat_template_kwargs, both handed to the chat template.
    tools: list[dict] | None = None
    chat_template_kwargs: dict | None = None
    lora_request: LoRARequest | None = None  # the adapter "model" named (None: the base model)


class LoRAAdapters(msgspec.Struct, omit_defaults=True):
    """gateway -> every gateway and worker on ``LORA_ADAPTERS``: adapters loaded and names
    unloaded (idempotent: applying it twice changes nothing); also a gateway's answer on
    ``LORA_LIST`` (``loaded`` only: all it serves)."""

    loaded: list[LoRARequest] = []
    unloaded: list[str] = []


class TokenizeReply(msgspec.Struct, omit_defaults=True):
    """tokenizer -> gateway. ``error``: the prompt was refused and no sample reached a
    scheduler. Otherwise ``choices[i]`` is the scheduler's answer for ``request_ids[i]``:
    queued (by the engine and scheduler incarnation named, which the gateway watches to
    fail the request at once when that engine restarts or goes silent) or refused."""

    num_prompt_tokens: int = 0
    error: ErrorInfo | None = None
    choices: list[EngineRequestReply] = []


class TokenizeTextRequest(msgspec.Struct, omit_defaults=True, kw_only=True):
    """gateway -> tokenizer on ``TOKENIZER_TOKENIZE`` (vLLM's ``/tokenize``): the ids of
    a prompt, or of chat messages rendered with the template; nothing is scheduled.
    Exactly one of prompt / messages is set."""

    prompt: str | None = None
    messages: list[dict] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class TokenizeTextReply(msgspec.Struct, omit_defaults=True):
    """tokenizer -> gateway: the ids (and the vocabulary's token strings, when asked),
    with the model's max_model_len; or why not."""

    tokens: list[int] = []
    token_strs: list[str] | None = None
    max_model_len: int = 0
    error: ErrorInfo | None = None


class DetokenizeTokensRequest(msgspec.Struct, omit_defaults=True):
    """gateway -> tokenizer on ``TOKENIZER_DETOKENIZE`` (vLLM's ``/detokenize``)."""

    tokens: list[int]


class DetokenizeTokensReply(msgspec.Struct, omit_defaults=True):
    prompt: str = ""
    error: ErrorInfo | None = None


class EngineOutputBatch(msgspec.Struct, array_like=True, gc=False):
    """scheduler -> detokenizer: every request's new tokens of one step."""

    outputs: list[EngineOutput]
    # The engine whose scheduler made them: the one to ask for missing stop strings.
    engine_id: str = ""


class RequestStopStrings(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True, gc=False):
    """What the detokenizers must know of one request besides its tokens: its stop
    strings and its output text settings (``SamplingParams``' meaning)."""

    request_id: str
    stop: list[str]
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    @classmethod
    def of(cls, request_id: str, params: SamplingParams) -> "RequestStopStrings":
        return cls(request_id, params.stop, params.include_stop_str_in_output, params.skip_special_tokens,
                   params.spaces_between_special_tokens)


class StopStrings(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """scheduler -> every detokenizer replica (``llm.detokenize.stops``, no queue group),
    at most one per step: the stop strings of the requests it accepted since the last
    one, and the requests that ended (their entries can go). Also the answer to a
    ``StopStringsQuery`` (``added`` only: the ids it knows). Idempotent."""

    added: list[RequestStopStrings] = []
    finished: list[str] = []


class StopStringsQuery(msgspec.Struct, array_like=True, gc=False):
    """detokenizer -> the scheduler of ``EngineOutputBatch.engine_id`` (request/reply):
    the stop strings of these requests, which its cache lacks."""

    request_ids: list[str]


class TopLogprob(msgspec.Struct, array_like=True, gc=False):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(msgspec.Struct, array_like=True, gc=False):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class PromptLogprob(msgspec.Struct, array_like=True, gc=False):
    """One prompt position for the client: the prompt token first, then the top-n, each
    with its decoded text; ``rank`` is the prompt token's (1 = the most likely). Empty
    ``logprobs``: the prompt's first token, which nothing predicts."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int
    decoded: list[str]


class StreamDelta(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """detokenizer -> gateway: the text of tokens [token_offset, token_offset +
    num_tokens) of one request's output. The gateway writes deltas in offset
    order; ``finish_reason`` set means the stream ends after this delta."""

    request_id: str
    token_offset: int
    num_tokens: int
    text: str
    finish_reason: FinishReason = FinishReason.NONE
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] = []
    error: str = ""
    # vLLM's ``stop_reason``, with the finish reason: the stop string matched or the
    # stop token id that ended the request; None for EOS and length.
    stop_reason: str | int | None = None
    # With the first output token, when asked for (EngineOutput.prompt_logprobs, decoded).
    prompt_logprobs: list[PromptLogprob] = []
    # P/D: the engine that holds the request from now on (EngineOutput.owner_engine_id).
    engine_id: str = ""
    incarnation: str = ""


class StreamDeltaBatch(msgspec.Struct, array_like=True, gc=False):
    deltas: list[StreamDelta]


class EngineStats(msgspec.Struct, omit_defaults=True):
    """scheduler -> anyone (gateways for /metrics), published every second."""

    engine_id: str
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_cache_usage_perc: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    ready: bool = False
    timestamp: float = 0.0
    incarnation: str = ""
    # Speculative decoding (vLLM's names): draft runs verified, their draft tokens, the
    # accepted ones, and acceptances by draft position.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = []
    # P/D (KVTransferConfig): the engine's role, requests whose prompt KV is being pulled,
    # and the KV transfers so far (decode side: bytes pulled by every rank, seconds from
    # hand-off to loaded summed over requests, loads, failed loads, recomputed prompts).
    kv_role: str = ""
    num_requests_waiting_for_remote_kv: int = 0
    kv_transfer_bytes: int = 0
    kv_transfer_seconds: float = 0.0
    kv_transfer_requests: int = 0
    kv_transfer_failures: int = 0
    kv_transfer_fallbacks: int = 0
    # LoRA (vLLM's lora_requests_info): names of the adapters with running / waiting
    # requests, and --max-loras (0: LoRA off).
    running_lora_adapters: list[str] = []
    waiting_lora_adapters: list[str] = []
    max_lora: int = 0


class WorkerReady(msgspec.Struct, omit_defaults=True):
    """worker -> scheduler: this rank is up, with its share of the KV cache."""

    engine_id: str
    rank: int
    world_size: int
    instance_id: str
    num_blocks: int
    max_model_len: int
    block_size: int
    vocab_size: int = 0  # the scheduler refuses token ids outside it (0: unknown)
    # Per KV cache group, its sliding window (0: full attention); empty: one
    # full-attention group (shared/kv_cache_groups.py).
    sliding_windows: list[int] = []


class WorkerRetire(msgspec.Struct, omit_defaults=True):
    """scheduler -> workers: these instances belong to a failed TP group and must exit."""

    engine_id: str
    instance_ids: list[str]


# --------------------------------------------------------------------------- P/D disaggregation


class KVTransferParams(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True, gc=False):
    """Where a handed-off request's prompt KV lies (vLLM's ``kv_transfer_params``): the
    first ``num_remote_tokens`` tokens, in ``num_remote_blocks`` blocks held by engine
    ``remote_engine_id`` (scheduler incarnation ``remote_incarnation``) with ``remote_world_size``
    TP ranks and ``remote_block_size`` tokens per block."""

    remote_engine_id: str
    remote_incarnation: str
    num_remote_tokens: int
    num_remote_blocks: int
    remote_world_size: int = 1
    remote_block_size: int = 16


class KVHandoff(msgspec.Struct, omit_defaults=True):
    """prefill scheduler -> decode scheduler (``engine_kv_handoff_subject``, request/reply):
    go on with this request; its prompt's KV is held for you (``kv_transfer_params``) and its
    first output token(s) are already sent to the client. Idempotent: a known id is taken
    as accepted."""

    request: EngineRequest
    output_token_ids: list[int]
    kv_transfer_params: KVTransferParams
    num_cached_tokens: int = 0


class KVHandoffReply(msgspec.Struct, omit_defaults=True):
    """decode scheduler -> prefill scheduler: taken (by the engine and incarnation named), or
    why not (the prefill side then tries another engine or decodes it itself)."""

    accepted: bool
    error: str = ""
    engine_id: str = ""
    incarnation: str = ""


class KVRelease(msgspec.Struct, omit_defaults=True):
    """decode scheduler -> prefill scheduler (``engine_kv_release_subject``): the held blocks
    of these requests (of scheduler incarnation ``incarnation``) may go. Idempotent; a lost
    one costs the hold until its timeout."""

    request_ids: list[str]
    incarnation: str


class KVPull(msgspec.Struct, array_like=True, gc=False):
    """decode worker rank -> the same prefill worker rank (``engine_kv_pull_subject``): the
    KV of blocks ``first_block .. first_block + num_blocks`` of held request ``req_id``, layers
    ``first_layer .. first_layer + num_layers``."""

    req_id: str
    incarnation: str
    first_block: int
    num_blocks: int
    first_layer: int
    num_layers: int


class KVChunk(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The answer to a ``KVPull``: per layer, keys then values of the blocks, raw
    (``services/worker/kv_transfer/block_io.py``); or an error, ``retry`` when the blocks are
    not served yet (the step that starts serving them is still on its way)."""

    data: bytes = b""
    error: str = ""
    retry: bool = False


class KVRecvDone(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """decode worker rank -> rank 0 of its engine (``engine_kv_recvd_subject``): loads this
    rank finished and failed. Idempotent."""

    rank: int
    finished: list[str] = []
    failed: list[str] = []


class KVLoadsDone(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """decode worker rank 0 -> its scheduler (``engine_kv_loaded_subject``): loads every rank
    finished and loads some rank failed, pushed when they end while no step runs there (a
    step's ``ModelRunnerOutput`` carries them otherwise), and the bytes rank 0 pulled. The next
    step's result repeats the ids (the scheduler ignores loads it no longer waits for), so a
    lost push costs the wait for the scheduler's next step."""

    incarnation: str
    finished: list[str] = []
    failed: list[str] = []
    kv_bytes: int = 0


class ServiceRestarts(msgspec.Struct, omit_defaults=True):
    """launcher -> gateways: restarts so far, by service process name (e.g. "worker-0")."""

    counts: dict[str, int]


class Ping(msgspec.Struct, omit_defaults=True):
    pass


class Pong(msgspec.Struct, omit_defaults=True):
    service: str
    instance_id: str
    info: dict = {}


# --------------------------------------------------------------------------- codecs


class Codec:
    """A msgpack encoder/decoder pair for one message type, made once."""

    __slots__ = ("type", "_encoder", "_decoder")

    def __init__(self, message_type: type) -> None:
        self.type = message_type
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(message_type)

    def encode(self, message) -> bytes:
        return self._encoder.encode(message)

    def decode(self, data: bytes):
        return self._decoder.decode(data)


SCHEDULER_OUTPUT = Codec(SchedulerOutput)
MODEL_RUNNER_OUTPUT = Codec(ModelRunnerOutput)
ENGINE_REQUEST = Codec(EngineRequest)
ENGINE_OUTPUT = Codec(EngineOutput)
ABORT_REQUEST = Codec(AbortRequest)
RESEND_OUTPUTS = Codec(ResendOutputs)
TOKENIZE_REQUEST = Codec(TokenizeRequest)
TOKENIZE_REPLY = Codec(TokenizeReply)
ENGINE_REQUEST_REPLY = Codec(EngineRequestReply)
TOKENIZE_TEXT_REQUEST = Codec(TokenizeTextRequest)
TOKENIZE_TEXT_REPLY = Codec(TokenizeTextReply)
DETOKENIZE_TOKENS_REQUEST = Codec(DetokenizeTokensRequest)
DETOKENIZE_TOKENS_REPLY = Codec(DetokenizeTokensReply)
ENGINE_OUTPUT_BATCH = Codec(EngineOutputBatch)
STOP_STRINGS = Codec(StopStrings)
STOP_STRINGS_QUERY = Codec(StopStringsQuery)
STREAM_DELTA_BATCH = Codec(StreamDeltaBatch)
ENGINE_STATS_MSG = Codec(EngineStats)
WORKER_READY = Codec(WorkerReady)
WORKER_RETIRE = Codec(WorkerRetire)
SERVICE_RESTARTS_MSG = Codec(ServiceRestarts)
LORA_ADAPTERS_MSG = Codec(LoRAAdapters)
PONG = Codec(Pong)
KV_HANDOFF = Codec(KVHandoff)
KV_HANDOFF_REPLY = Codec(KVHandoffReply)
KV_RELEASE = Codec(KVRelease)
KV_PULL = Codec(KVPull)
KV_CHUNK = Codec(KVChunk)
KV_RECV_DONE = Codec(KVRecvDone)
KV_LOADS_DONE = Codec(KVLoadsDone)
KV_CONNECTOR_METADATA = Codec(KVConnectorMetadata)
