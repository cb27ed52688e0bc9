"""Parsing OpenAI chat / completions request bodies into one ``GenerationRequest``.

The gateway checks shapes and types at the edge (a wrong type names its parameter
in a 400); value ranges (temperature in [0, 2], ...) and the messages' roles and
content are the tokenizer service's to check, and its error passes through.
Absent settings take OpenAI's / vLLM's defaults. ``SamplingParams.max_tokens == 0``
tells the tokenizer "not given: as many as fit in the context" (max_model_len -
prompt_len): chat without max_tokens / max_completion_tokens, and completions with
``max_tokens: null``; completions without the field get 16, as in OpenAI's API and
vLLM.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import msgspec

from shared.prompt_truncation import SIDE_PARAM, SIDES, check_side
from shared.request_validation import InvalidRequest
from shared.protocol import LoRARequest, SamplingParams

from .errors import ApiError, invalid
from .echo import echo_params
from .logit_controls import logit_controls
from .output_fields import output_text_settings, prompt_logprobs, prompt_settings
from .structured_outputs import structured_outputs
from .tool_choice import ToolCalling, chat_template_kwargs, tool_calling, tool_constraint

MAX_N = 128
# Stop strings size every step output's token window, fill the detokenizers' caches and
# are matched against every delta: bounded, so that no request can make a step message
# or a detokenizer's work explode.
MAX_STOP_STRINGS = 64
MAX_NON_STREAMED_ENTRIES = 1 << 18
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_SUB_REQUESTS = 256
# vLLM's CompletionRequest (and OpenAI's legacy completions API) default to 16 tokens;
# chat completions default to "as many as fit".
COMPLETION_DEFAULT_MAX_TOKENS = 16
MAX_TOKENS_NOT_GIVEN = 0
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

_MISSING = object()

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationRequest:
    """A checked chat or completions request, ready to fan out into engine requests.

    ``prompts`` holds, per prompt, the prompt fields of a ``TokenizeRequest``
    (``messages``, ``prompt`` or ``prompt_token_ids``). Choice ``p * n + i`` is
    prompt ``p``'s ``i``-th sample.
    """

    kind: str  # "chat" | "completion"
    model: str
    prompts: tuple[dict, ...]
    sampling_params: SamplingParams
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    stream_interval: int = 1  # tokens per streamed chunk asked for (the server's --stream-interval may raise it)
    logprobs: bool = False
    add_generation_prompt: bool = True
    cache_salt: str = ""
    # The client asked for prompt_logprobs (they are in the response).
    prompt_logprobs: bool = False
    # Completions: the prompt's text (and logprobs) before the completion's.
    echo: bool = False
    tool_calling: ToolCalling | None = None  # chat: tools, tool_choice (services/gateway/tool_choice.py)
    # vLLM's request_id: the response's id is "<chatcmpl|cmpl>-" and it (the engines' own
    # ids stay unique); the X-Request-Id header wins over it, as in vLLM.
    client_request_id: str = ""
    # vLLM's return_token_ids: the prompt's and each choice's token ids in the response.
    return_token_ids: bool = False
    lora_request: LoRARequest | None = None  # "model" named this LoRA adapter

    def __post_init__(self) -> None:
        # A non-streamed answer is built whole in the gateway's memory: bound its size.
        params = self.sampling_params
        if not self.stream and params.max_tokens:
            entries = len(self.prompts) * self.n * params.max_tokens * (1 + (params.logprobs or 0))
            if entries > MAX_NON_STREAMED_ENTRIES:
                raise invalid(
                    f"a non-streamed answer may hold at most {MAX_NON_STREAMED_ENTRIES} tokens and logprobs "
                    f"(prompts x n x max_tokens x (1 + top logprobs) = {entries}); stream it, or ask for less",
                    param="max_tokens",
                )


class Fields:
    """Typed reads of a JSON object's optional fields; ``None`` counts as absent."""

    def __init__(self, body: dict) -> None:
        self.body = body

    def has(self, name: str) -> bool:
        return self.body.get(name) is not None

    def raw(self, name: str, default=None):
        value = self.body.get(name, default)
        return default if value is None else value

    def bool(self, name: str, default: bool) -> bool:
        value = self.raw(name, default)
        if not isinstance(value, bool):
            raise invalid(f"{name} must be a boolean, got {value!r}", param=name)
        return value

    def int(self, name: str, default, minimum: int | None = None):
        if not self.has(name):
            return default
        value = self.body[name]
        if isinstance(value, bool) or not isinstance(value, int):
            raise invalid(f"{name} must be an integer, got {value!r}", param=name)
        if minimum is not None and value < minimum:
            raise invalid(f"{name} must be at least {minimum}, got {value}", param=name)
        if not INT64_MIN <= value <= INT64_MAX:
            raise invalid(f"{name} is out of range: {value}", param=name)
        return value

    def float(self, name: str, default: float) -> float:
        value = self.raw(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise invalid(f"{name} must be a number, got {value!r}", param=name)
        return float(value)

    def str(self, name: str, default: str) -> str:
        value = self.raw(name, default)
        if not isinstance(value, str):
            raise invalid(f"{name} must be a string, got {value!r}", param=name)
        return value

    def str_list(self, name: str) -> list[str]:
        """A string or a list of strings (as ``stop``), always as a list."""
        value = self.raw(name, [])
        if isinstance(value, str):
            return [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise invalid(f"{name} must be a string or a list of strings", param=name)
        return value

    def int_list(self, name: str) -> list[int]:
        value = self.raw(name, [])
        if not isinstance(value, list) or not all(_is_int(v) for v in value):
            raise invalid(f"{name} must be a list of integers", param=name)
        return value


def _is_int(value) -> bool:
    """A JSON integer that fits the bus's 64-bit ints."""
    return isinstance(value, int) and not isinstance(value, bool) and INT64_MIN <= value <= INT64_MAX


def _as_object(body) -> Fields:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    return Fields(_ReadFields(body))


class _ReadFields(dict):
    """A request body that remembers which of its fields the parsing read."""

    def __init__(self, body: dict) -> None:
        super().__init__(body)
        self.read: set[str] = set(NO_EFFECT_FIELDS)

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key) -> bool:
        self.read.add(key)
        return super().__contains__(key)


MAX_LOGGED_FIELDS = 10  # a client's field names in one log line, each cut to 64 characters


def _log_ignored(f: Fields) -> None:
    """vLLM's warning for the fields of a request that nothing reads (unknown to both)."""
    ignored = sorted(set(f.body) - f.body.read)
    if ignored:
        names = [name[:64] for name in ignored[:MAX_LOGGED_FIELDS]]
        more = f" and {len(ignored) - MAX_LOGGED_FIELDS} more" if len(ignored) > MAX_LOGGED_FIELDS else ""
        logger.warning("The following fields were present in the request but ignored: %s%s", names, more)


def check_model(f: Fields, served_model_names: tuple[str, ...]) -> str:
    """The served name the response reports; an unknown name is a 404 (model_not_found), as vLLM."""
    if not f.has("model"):
        return served_model_names[0]
    model = f.str("model", "")
    if model not in served_model_names:
        raise ApiError(
            f"The model `{model}` does not exist. Served: {', '.join(served_model_names)}",
            status=404,
            type="not_found_error",
            param="model",
            code="model_not_found",
        )
    return served_model_names[0]


def _stop_strings(f: Fields) -> list[str]:
    stop = list(dict.fromkeys(f.str_list("stop")))  # a set, in the order given
    if len(stop) > MAX_STOP_STRINGS:
        raise invalid(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}", param="stop")
    if any(len(s) > MAX_STOP_STRING_CHARS for s in stop):
        raise invalid(f"each stop string may be at most {MAX_STOP_STRING_CHARS} characters long", param="stop")
    return stop


def _stop_token_ids(f: Fields) -> list[int]:
    """A set, in the order given: a repeated id means nothing more."""
    ids = list(dict.fromkeys(f.int_list("stop_token_ids")))
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise invalid(f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}",
                      param="stop_token_ids")
    return ids


def _sampling_params(f: Fields, max_tokens: int, logprobs: int | None) -> SamplingParams:
    seed = f.int("seed", None)
    return SamplingParams(
        temperature=f.float("temperature", 1.0),
        top_p=f.float("top_p", 1.0),
        top_k=f.int("top_k", 0),
        min_p=f.float("min_p", 0.0),
        seed=seed,
        presence_penalty=f.float("presence_penalty", 0.0),
        frequency_penalty=f.float("frequency_penalty", 0.0),
        repetition_penalty=f.float("repetition_penalty", 1.0),
        max_tokens=max_tokens,
        min_tokens=f.int("min_tokens", 0, minimum=0),
        stop_token_ids=_stop_token_ids(f),
        stop=_stop_strings(f),
        ignore_eos=f.bool("ignore_eos", False),
        logprobs=logprobs,
        structured_outputs=structured_outputs(f.body),
        **logit_controls(f),
        **output_text_settings(f),
        **prompt_settings(f),
        prompt_logprobs=prompt_logprobs(f),
    )


# vLLM's fields that change nothing here, as in vLLM for a model like ours: they pass
# whatever their value. No reasoning parser (reasoning_effort, include_reasoning), no beam
# search (length_penalty, early_stopping), render endpoints only (return_token_offsets),
# routed experts' data only (routed_experts_prompt_start). OpenAI's fields that vLLM does
# not know (store, metadata, prediction, ...) are logged as ignored, as vLLM logs them.
NO_EFFECT_FIELDS = frozenset({
    "user", "session_id", "reasoning_effort", "include_reasoning", "length_penalty", "early_stopping",
    "return_token_offsets", "routed_experts_prompt_start",
})
# Fields of OpenAI's and vLLM's requests that this server does not honour yet, each with
# the values that ask for nothing (those pass): any other value is a 400 naming the
# field, never an answer that silently differs from what was asked. A field in neither
# table nor read by the parsing is logged as ignored, as vLLM logs it.
UNSUPPORTED_FIELDS: dict[str, tuple] = {
    "functions": (None, []),
    "function_call": (None, "none"),
    "use_beam_search": (None, False),
    "watermarking": (None, False),
    "logprob_token_ids": (None, []),
    "return_prompt_text": (None, False),
    "thinking_token_budget": (None,),
    "repetition_detection": (None,),
    "priority": (None, 0),  # vLLM refuses it too unless --scheduling-policy priority
    "vllm_xargs": (None, {}),
    "kv_transfer_params": (None,),  # P/D is the engines' own here (--prefill-engines)
    "ec_transfer_params": (None,),
    "mm_payload": (None,),
    "mm_processor_kwargs": (None, {}),
    "media_io_kwargs": (None, {}),
    "return_mm_kwargs": (None, False),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "web_search_options": (None,),
}
# vLLM refuses a request's own chat template unless started with
# --trust-request-chat-template; this server takes only --chat-template.
CHAT_UNSUPPORTED_FIELDS: dict[str, tuple] = {"chat_template": (None,)}
COMPLETION_UNSUPPORTED_FIELDS: dict[str, tuple] = {"prompt_embeds": (None,)}
# Chat's fields that /v1/completions has no use for: refused there unless inert.
CHAT_ONLY_FIELDS: dict[str, tuple] = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None,),
    "chat_template_kwargs": (None, {}),
    "continue_final_message": (None, False),
    "documents": (None, []),
}


def _refuse_unsupported(f: Fields, n: int) -> None:
    _refuse(f, UNSUPPORTED_FIELDS)
    best_of = f.body.get("best_of")
    if best_of is not None and not (_is_int(best_of) and best_of == n):
        raise invalid(f"best_of is not supported by this server (only null or equal to n = {n})", param="best_of")


def _refuse(f: Fields, fields: dict[str, tuple]) -> None:
    for name, inert in fields.items():
        value = f.body.get(name)
        if not any(type(value) is type(ok) and value == ok for ok in inert):
            raise invalid(f"{name} is not supported by this server (only {_inert_text(inert)})", param=name)


def _inert_text(inert: tuple) -> str:
    return " or ".join(json.dumps(v) for v in inert)


def _common(f: Fields) -> dict:
    """Settings shared by chat and completions: n, stream, stream_options, stream_interval,
    user, request_id; refuses the fields we cannot honour."""
    n = f.int("n", 1, minimum=1)
    if n > MAX_N:
        raise invalid(f"n must be at most {MAX_N}, got {n}", param="n")
    _refuse_unsupported(f, n)
    seed = f.int("seed", None)
    if seed is not None and seed + n - 1 > INT64_MAX:
        raise invalid(f"seed + n - 1 must fit in a signed 64-bit integer, got seed={seed}", param="seed")
    stream = f.bool("stream", False)
    include_usage = False
    if f.has("stream_options"):
        if not stream:
            raise invalid("stream_options can only be given when stream is true", param="stream_options")
        options = f.raw("stream_options")
        if not isinstance(options, dict):
            raise invalid("stream_options must be an object", param="stream_options")
        include_usage = Fields(options).bool("include_usage", False)
    f.str("user", "")
    return {"n": n, "stream": stream, "include_usage": include_usage,
            "stream_interval": f.int("stream_interval", 1, minimum=1), "cache_salt": f.str("cache_salt", ""),
            "prompt_logprobs": f.has("prompt_logprobs"), "client_request_id": f.str("request_id", ""),
            "return_token_ids": f.bool("return_token_ids", False)}


def _max_tokens(f: Fields, names: tuple[str, ...], absent: int) -> int:
    """The first of ``names`` given (>= 1); ``absent`` when none is in the body at all,
    "not given" (0) when one is there as null."""
    for name in names:
        if f.has(name):
            return f.int(name, None, minimum=1)
    if any(name in f.body for name in names):
        return MAX_TOKENS_NOT_GIVEN
    return absent


# --------------------------------------------------------------------------- chat


def parse_chat(body, served_model_names: tuple[str, ...]) -> GenerationRequest:
    f = _as_object(body)
    model = check_model(f, served_model_names)
    messages = chat_messages(f.body.get("messages", _MISSING))
    logprobs = f.bool("logprobs", False)
    top_logprobs = f.int("top_logprobs", None, minimum=0)
    if top_logprobs is not None and not logprobs:
        raise invalid("when top_logprobs is given, logprobs must be true", param="top_logprobs")
    if f.bool("echo", False):  # vLLM's chat echo (the last message) is another thing
        raise invalid("echo is not supported on chat completions by this server (only null or false)", param="echo")
    _refuse(f, CHAT_UNSUPPORTED_FIELDS)
    common = _common(f)
    max_tokens = _max_tokens(f, ("max_completion_tokens", "max_tokens"), MAX_TOKENS_NOT_GIVEN)
    params = _sampling_params(f, max_tokens, (top_logprobs or 0) if logprobs else None)
    tools = tool_calling(f.body)
    constraint = tool_constraint(tools)
    if constraint is not None:
        if params.structured_outputs is not None:
            raise invalid("tool_choice 'required' or a named function cannot be combined with structured output",
                          param="tool_choice")
        params = msgspec.structs.replace(params, structured_outputs=constraint)
    add_generation_prompt, continue_final_message = generation_prompt_fields(f)
    prompt = {"messages": messages, "tools": list(tools.tools) if tools and tools.tools else None,
              "chat_template_kwargs": _with_documents(f, chat_template_kwargs(f.body)),
              **_prompt_rendering(f, add_special_tokens=False)}
    if continue_final_message:
        prompt["continue_final_message"] = True
    for name in ("tools", "chat_template_kwargs"):
        if not _fits_bus(prompt[name]):
            raise invalid(f"{name} has an integer outside the signed 64-bit range", param=name)
    _log_ignored(f)
    return GenerationRequest(
        kind="chat",
        model=model,
        prompts=(prompt,),
        sampling_params=params,
        logprobs=logprobs,
        add_generation_prompt=add_generation_prompt,
        tool_calling=tools,
        **common,
    )


def generation_prompt_fields(f: Fields) -> tuple[bool, bool]:
    """``add_generation_prompt`` (default true) and ``continue_final_message`` (vLLM's: the
    prompt ends inside the final message), which exclude each other."""
    add_generation_prompt = f.bool("add_generation_prompt", True)
    continue_final_message = f.bool("continue_final_message", False)
    if continue_final_message and add_generation_prompt:
        raise invalid("continue_final_message cannot be combined with add_generation_prompt (true unless given): "
                      "set add_generation_prompt to false", param="continue_final_message")
    return add_generation_prompt, continue_final_message


def _with_documents(f: Fields, template_kwargs: dict | None) -> dict | None:
    """vLLM's ``documents`` (for retrieval-augmented templates: objects of strings, such as
    ``{"title", "text"}``) reach the template as ``documents``; ``chat_template_kwargs``
    may set that name too, and wins, as in vLLM."""
    documents = f.raw("documents", [])
    if not isinstance(documents, list) or not all(
            isinstance(d, dict) and all(isinstance(v, str) for v in d.values()) for d in documents):
        raise invalid("documents must be a list of objects whose values are strings", param="documents")
    if not documents:
        return template_kwargs
    return {"documents": documents, **(template_kwargs or {})}


def _prompt_rendering(f: Fields, add_special_tokens: bool) -> dict:
    """The ``TokenizeRequest`` fields of vLLM's ``add_special_tokens`` (the route's default
    given) and ``truncation_side``, those that differ from their defaults."""
    fields = {}
    if f.bool("add_special_tokens", add_special_tokens) != add_special_tokens:
        fields["add_special_tokens"] = not add_special_tokens
    side = f.str(SIDE_PARAM, SIDES[0])
    try:
        check_side(side)
    except InvalidRequest as e:
        raise ApiError.from_info(e.error) from e
    if side != SIDES[0]:
        fields[SIDE_PARAM] = side
    return fields


def chat_messages(messages) -> list[dict]:
    """The messages as JSON gave them, a list of objects; roles and content are the
    tokenizer's to check and normalise (``shared.request_validation.chat_messages``)."""
    if messages is _MISSING or messages is None:
        raise invalid("messages is required", param="messages")
    if not isinstance(messages, list):
        raise invalid("messages must be a list of message objects", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise invalid(f"messages[{i}] must be an object", param="messages")
        if not _fits_bus(message):
            raise invalid(f"messages[{i}] has an integer outside the signed 64-bit range", param="messages")
    return messages


def _fits_bus(value) -> bool:
    """Whether a JSON value can be passed on as it is (the bus's integers are 64-bit)."""
    if isinstance(value, dict):
        return all(_fits_bus(v) for v in value.values())
    if isinstance(value, list):
        return all(_fits_bus(v) for v in value)
    return isinstance(value, bool) or _is_int(value) or not isinstance(value, int)


# --------------------------------------------------------------------------- completions


def parse_completion(body, served_model_names: tuple[str, ...]) -> GenerationRequest:
    f = _as_object(body)
    model = check_model(f, served_model_names)
    prompts = completion_prompts(f.body.get("prompt", _MISSING))
    if f.has("suffix"):
        raise invalid("suffix is not supported", param="suffix")
    logprobs = f.int("logprobs", None, minimum=0)
    common = _common(f)
    _refuse(f, COMPLETION_UNSUPPORTED_FIELDS)
    _refuse(f, CHAT_ONLY_FIELDS)
    rendering = _prompt_rendering(f, add_special_tokens=True)
    prompts = [{**prompt, **rendering} for prompt in prompts]
    if len(prompts) * common["n"] > MAX_SUB_REQUESTS:
        raise invalid(
            f"at most {MAX_SUB_REQUESTS} choices per request (prompts x n), got {len(prompts) * common['n']}",
            param="n",
        )
    max_tokens = _max_tokens(f, ("max_tokens",), COMPLETION_DEFAULT_MAX_TOKENS)
    params = _sampling_params(f, max_tokens, logprobs)
    echo = f.bool("echo", False)
    if echo:
        params = echo_params(prompts, params)
    _log_ignored(f)
    return GenerationRequest(
        kind="completion",
        model=model,
        prompts=tuple(prompts),
        sampling_params=params,
        logprobs=logprobs is not None,
        echo=echo,
        **common,
    )


def completion_prompts(prompt) -> list[dict]:
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""
    shapes = "a string, a list of strings, a list of token ids or a list of token-id lists"
    if prompt is _MISSING or prompt is None:
        raise invalid("prompt is required", param="prompt")
    if isinstance(prompt, str):
        return [{"prompt": prompt}]
    if not isinstance(prompt, list) or not prompt:
        raise invalid(f"prompt must be {shapes} (and not empty)", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        return [{"prompt": p} for p in prompt]
    if all(_is_int(t) for t in prompt):
        return [{"prompt_token_ids": prompt}]
    if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt):
        return [{"prompt_token_ids": p} for p in prompt]
    raise invalid(f"prompt must be {shapes} (and not empty)", param="prompt")
