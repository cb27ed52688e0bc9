"""The request's way through the services, and back as text.

    gateway -> tokenizer (TokenizeRequest) -> scheduler (EngineRequest, on the engine its
               router chose, else the schedulers' queue group)
    scheduler -> detokenizer (EngineOutputBatch) -> gateway (StreamDeltaBatch)
    scheduler -> every detokenizer (StopStrings, once per request)
    gateway -> schedulers: aborts and resends, on the gateway's own subjects

Also the gateway's ``/tokenize`` and ``/detokenize``, answered by the tokenizers.
"""

from __future__ import annotations

import msgspec

from shared.protocol.codec import SUBJECT_PREFIX, Channel, Codec
from shared.protocol.common import ErrorInfo, FinishReason, Logprobs, LoRARequest, SamplingParams

# --------------------------------------------------------------------------- subjects

TOKENIZE = f"{SUBJECT_PREFIX}.tokenize"
DETOKENIZE = f"{SUBJECT_PREFIX}.detokenize"
# Schedulers broadcast their requests' stop strings to every detokenizer replica (no queue group).
DETOKENIZE_STOPS = f"{DETOKENIZE}.stops"
ENGINE_REQUESTS = f"{SUBJECT_PREFIX}.engine.requests"
# Aborts and resend requests travel per gateway (``ABORT_CHANNEL``...): only a gateway
# may publish on its own, and schedulers obey them only for its own requests.
# Outside llm.engine.*: a gateway id must never make a subject like llm.engine.<id>.step.
ENGINE_ABORT = f"{SUBJECT_PREFIX}.abort"
# Gateways ask for the outputs of a stream's gap again (a detokenizer died with them).
ENGINE_RESEND = f"{SUBJECT_PREFIX}.resend"
# The gateway's /tokenize and /detokenize (request/reply, tokenizer queue group).
TOKENIZER_TOKENIZE = f"{SUBJECT_PREFIX}.tokenizer.tokenize"
TOKENIZER_DETOKENIZE = f"{SUBJECT_PREFIX}.tokenizer.detokenize"


def subject_gateway_id(subject: str) -> str:
    """The gateway id a per-gateway subject ends with."""
    return subject.rsplit(".", 1)[-1]


# --------------------------------------------------------------------------- gateway -> tokenizer -> scheduler


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
    # A request resumed after its engine was lost: the output tokens its client already
    # has. It is recomputed from prompt + these and its outputs go on from there.
    output_token_ids: list[int] = []


class EngineRequestReply(msgspec.Struct, omit_defaults=True):
    """scheduler -> tokenizer: the request was queued, or why not."""

    request_id: str
    error: ErrorInfo | None = None
    engine_id: str = ""
    # Random per scheduler process: a restarted scheduler has a new one (EngineStats too).
    incarnation: str = ""
    # The engine's count of requests admitted, this one included (0: not admitted now):
    # a router counts the request as load until the engine's stats count it too
    # (``EngineStats.num_requests_admitted``).
    admission: int = 0


class ResumedSample(msgspec.Struct, array_like=True, gc=False):
    """A sample sent again because the engine that held it was lost: which of its
    prompt's ``n`` samples it is (its seed is seed + ``choice``) and the output tokens its
    client already received (the engine goes on after them)."""

    choice: int
    output_token_ids: list[int]


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
    # vLLM's fields. Chat only: the prompt ends inside the final message, which the model
    # goes on with. The ids the tokenizer adds around a text (BOS, ...): None is the
    # default, added to a prompt, not to messages (their template has them).
    continue_final_message: bool = False
    add_special_tokens: bool | None = None
    # Which end truncate_prompt_tokens keeps: "left" cuts the start (keeps the last k).
    truncation_side: str = "left"
    # The reply carries the prompt's ids (vLLM's return_token_ids).
    return_prompt_token_ids: bool = False
    lora_request: LoRARequest | None = None  # the adapter "model" named (None: the base model)
    # Resumed samples (their engine was lost), one per request id; empty: new samples
    # (request_ids[i] is sample i).
    resumed: list[ResumedSample] = []


class TokenizeReply(msgspec.Struct, omit_defaults=True):
    """tokenizer -> gateway. ``error``: the prompt was refused and no sample reached a
    scheduler. Otherwise ``choices[i]`` is the scheduler's answer for ``request_ids[i]``:
    queued (by the engine and scheduler incarnation named, which the gateway watches to
    fail the request at once when that engine restarts or goes silent) or refused."""

    num_prompt_tokens: int = 0
    error: ErrorInfo | None = None
    choices: list[EngineRequestReply] = []
    prompt_token_ids: list[int] = []  # when the request asked for them


class TokenizeTextRequest(msgspec.Struct, omit_defaults=True, kw_only=True):
    """gateway -> tokenizer on ``TOKENIZER_TOKENIZE`` (vLLM's ``/tokenize``): the ids of
    a prompt, or of chat messages rendered with the template; nothing is scheduled.
    Exactly one of prompt / messages is set."""

    prompt: str | None = None
    messages: list[dict] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
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


# --------------------------------------------------------------------------- scheduler -> detokenizer -> gateway


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
    # Tracing (shared/tracing.py): the W3C traceparent of the request's engine span, on its
    # first and its last output only (the detokenizer's spans join the trace).
    trace_context: str = ""


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
    return_tokens_as_token_ids: bool = False

    @classmethod
    def of(cls, request_id: str, params: SamplingParams) -> "RequestStopStrings":
        return cls(request_id, params.stop, params.include_stop_str_in_output, params.skip_special_tokens,
                   params.spaces_between_special_tokens, params.return_tokens_as_token_ids)


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
    # The token ids of the delta (``num_tokens`` of them): the gateway keeps what its
    # client received, to resume the request elsewhere if its engine is lost.
    token_ids: list[int] = []


class StreamDeltaBatch(msgspec.Struct, array_like=True, gc=False):
    deltas: list[StreamDelta]


# --------------------------------------------------------------------------- codecs and channels

ENGINE_REQUEST = Codec(EngineRequest)
ENGINE_REQUEST_REPLY = Codec(EngineRequestReply)
ENGINE_OUTPUT = Codec(EngineOutput)
ABORT_REQUEST = Codec(AbortRequest)
RESEND_OUTPUTS = Codec(ResendOutputs)
TOKENIZE_REQUEST = Codec(TokenizeRequest)
TOKENIZE_REPLY = Codec(TokenizeReply)
TOKENIZE_TEXT_REQUEST = Codec(TokenizeTextRequest)
TOKENIZE_TEXT_REPLY = Codec(TokenizeTextReply)
DETOKENIZE_TOKENS_REQUEST = Codec(DetokenizeTokensRequest)
DETOKENIZE_TOKENS_REPLY = Codec(DetokenizeTokensReply)
ENGINE_OUTPUT_BATCH = Codec(EngineOutputBatch)
STOP_STRINGS = Codec(StopStrings)
STOP_STRINGS_QUERY = Codec(StopStringsQuery)
STREAM_DELTA_BATCH = Codec(StreamDeltaBatch)

# A prompt to tokenize and schedule (request/reply, tokenizer queue group).
TOKENIZE_CHANNEL = Channel(TOKENIZE, TOKENIZE_REQUEST, TOKENIZE_REPLY)
TOKENIZE_TEXT_CHANNEL = Channel(TOKENIZER_TOKENIZE, TOKENIZE_TEXT_REQUEST, TOKENIZE_TEXT_REPLY)
DETOKENIZE_TOKENS_CHANNEL = Channel(TOKENIZER_DETOKENIZE, DETOKENIZE_TOKENS_REQUEST, DETOKENIZE_TOKENS_REPLY)
# A tokenized request for any scheduler (request/reply, scheduler queue group): the
# fallback when no router chose an engine.
ENGINE_REQUESTS_CHANNEL = Channel(ENGINE_REQUESTS, ENGINE_REQUEST, ENGINE_REQUEST_REPLY)
# A tokenized request a router placed on engine ``{}`` (request/reply).
ENGINE_REQUEST_CHANNEL = Channel(f"{SUBJECT_PREFIX}.engine.{{}}.requests", ENGINE_REQUEST, ENGINE_REQUEST_REPLY)
# Aborts of gateway ``{}``'s requests (by it, or by a detokenizer for a stop string);
# every scheduler listens on ``ABORT_CHANNEL.subject("*")``.
ABORT_CHANNEL = Channel(f"{ENGINE_ABORT}.{{}}", ABORT_REQUEST)
# Gateway ``{}`` asks for its requests' lost outputs again.
RESEND_CHANNEL = Channel(f"{ENGINE_RESEND}.{{}}", RESEND_OUTPUTS)
# Each step's new tokens, for any detokenizer (queue group).
ENGINE_OUTPUTS_CHANNEL = Channel(DETOKENIZE, ENGINE_OUTPUT_BATCH)
# Stop strings, to every detokenizer replica.
STOP_STRINGS_CHANNEL = Channel(DETOKENIZE_STOPS, STOP_STRINGS)
# A detokenizer asks engine ``{}``'s scheduler for stop strings it missed (request/reply).
STOP_STRINGS_QUERY_CHANNEL = Channel(f"{SUBJECT_PREFIX}.engine.{{}}.stops", STOP_STRINGS_QUERY, STOP_STRINGS)
# Text deltas for the requests gateway replica ``{}`` owns.
STREAM_CHANNEL = Channel(f"{SUBJECT_PREFIX}.stream.{{}}", STREAM_DELTA_BATCH)

engine_abort_subject = ABORT_CHANNEL.subject
engine_requests_subject = ENGINE_REQUEST_CHANNEL.subject
engine_resend_subject = RESEND_CHANNEL.subject
engine_stops_subject = STOP_STRINGS_QUERY_CHANNEL.subject
gateway_stream_subject = STREAM_CHANNEL.subject
