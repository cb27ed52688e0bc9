"""Request checks: OpenAI / vLLM ranges, chat messages, the context length; OpenAI's error shape.

Pure functions, no bus, used by ``request_preparation`` (the tokenizer service's
and the in-process engine's one way to prepare a request). Each check raises
``InvalidRequest`` carrying the ``ErrorInfo`` (status 400, the offending parameter
named) that the gateway hands to the client as is.
"""

from __future__ import annotations

import json
import math

import msgspec

from shared.protocol import ErrorInfo, SamplingParams, TokenizeRequest

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
MAX_LOGPROBS = 20
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class InvalidRequest(ValueError):
    """The request cannot be served as sent; ``error`` says why, for the client."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.error = ErrorInfo(message, type="invalid_request_error", param=param, code=code, status=400)


def _check_range(name: str, value: float, low: float, high: float, low_open: bool = False) -> None:
    ok = (low < value if low_open else low <= value) and value <= high
    if not ok:  # also catches NaN
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise InvalidRequest(f"{name} must be in {interval}, got {value}", param=name)


def validate_sampling_params(params: SamplingParams, vocab_size: int) -> SamplingParams:
    """Check every setting against its allowed range; return it normalised (top_k -1 -> 0).

    ``max_tokens == 0`` means "not given": it is resolved once the prompt length is
    known (``resolve_max_tokens``).
    """
    _check_range("temperature", params.temperature, 0.0, 2.0)
    _check_range("top_p", params.top_p, 0.0, 1.0, low_open=True)
    if params.top_k < -1:
        raise InvalidRequest(f"top_k must be -1 or 0 (disabled) or at least 1, got {params.top_k}", param="top_k")
    _check_range("min_p", params.min_p, 0.0, 1.0)
    _check_range("presence_penalty", params.presence_penalty, -2.0, 2.0)
    _check_range("frequency_penalty", params.frequency_penalty, -2.0, 2.0)
    if not (params.repetition_penalty > 0 and math.isfinite(params.repetition_penalty)):
        raise InvalidRequest(
            f"repetition_penalty must be a finite number > 0, got {params.repetition_penalty}",
            param="repetition_penalty",
        )
    if params.max_tokens < 0:
        raise InvalidRequest(f"max_tokens must be at least 1, got {params.max_tokens}", param="max_tokens")
    if params.min_tokens < 0:
        raise InvalidRequest(f"min_tokens must be at least 0, got {params.min_tokens}", param="min_tokens")
    if params.max_tokens > 0 and params.min_tokens > params.max_tokens:
        raise InvalidRequest(
            f"min_tokens ({params.min_tokens}) must be at most max_tokens ({params.max_tokens})", param="min_tokens"
        )
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise InvalidRequest(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}", param=name)
    for s in params.stop:
        if not s:
            raise InvalidRequest("stop strings must not be empty", param="stop")
    for token_id in params.stop_token_ids:
        if not 0 <= token_id < vocab_size:
            raise InvalidRequest(
                f"stop_token_ids has {token_id}, outside the vocabulary [0, {vocab_size})", param="stop_token_ids"
            )
    if params.top_k == -1:
        params = msgspec.structs.replace(params, top_k=0)
    return params


def chat_messages(messages: list[dict]) -> list[dict]:
    """The messages as the chat template takes them: a known role, string content, and
    the optional ``name``, ``tool_call_id`` and (assistant) ``tool_calls``.

    Null content is empty (an assistant turn that only called tools); content given as
    OpenAI text parts (``[{"type": "text", "text": ...}]``) is joined by newlines, as
    vLLM does.
    """
    if not messages:
        raise InvalidRequest("messages must not be empty", param="messages")
    result = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise InvalidRequest(
                f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}, got {role!r}", param="messages"
            )
        clean = {"role": role, "content": _message_content(message.get("content"), i)}
        for key in ("name", "tool_call_id"):
            if isinstance(message.get(key), str):
                clean[key] = message[key]
        if message.get("tool_calls") is not None:
            if role != "assistant":
                raise InvalidRequest(f"messages[{i}]: only assistant messages have tool_calls", param="messages")
            clean["tool_calls"] = [_tool_call(call, i, j) for j, call in enumerate(_list(message["tool_calls"], i))]
        result.append(clean)
    return result


def _list(value, i: int) -> list:
    if not isinstance(value, list):
        raise InvalidRequest(f"messages[{i}].tool_calls must be a list", param="messages")
    return value


def _tool_call(call, i: int, j: int) -> dict:
    """An assistant's earlier tool call as templates take it: ``{"id", "type": "function",
    "function": {"name", "arguments"}}`` with the arguments as an object (transformers'
    convention, which vLLM follows: OpenAI sends them as a JSON string)."""
    where = f"messages[{i}].tool_calls[{j}]"
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidRequest(f"{where} must be an object with a function {{name, arguments}}", param="messages")
    if call.get("type", "function") != "function":
        raise InvalidRequest(f"{where}.type must be 'function', got {call.get('type')!r}", param="messages")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as e:
            raise InvalidRequest(f"{where}.function.arguments is not valid JSON: {e}", param="messages") from e
    if not isinstance(arguments, dict):
        raise InvalidRequest(f"{where}.function.arguments must be a JSON object", param="messages")
    clean = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if isinstance(call.get("id"), str):
        clean["id"] = call["id"]
    return clean


def _message_content(content, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"messages[{i}].content must be a string or a list of content parts", param="messages")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InvalidRequest(
                f"messages[{i}].content: only text parts are supported, got {kind!r}", param="messages"
            )
        if not isinstance(part.get("text"), str):
            raise InvalidRequest(f"messages[{i}].content: a text part needs a string 'text'", param="messages")
        texts.append(part["text"])
    return "\n".join(texts)


def validate_request_shape(request: TokenizeRequest, vocab_size: int) -> None:
    """At least one sample, each seed a signed 64-bit integer; exactly one prompt form;
    token ids inside the vocabulary."""
    if not request.request_ids:
        raise InvalidRequest("a request needs at least one sample (request id)", param="n")
    seed = request.sampling_params.seed
    if seed is not None and not INT64_MIN <= seed <= seed + len(request.request_ids) - 1 <= INT64_MAX:
        raise InvalidRequest(f"seed + n - 1 must fit in a signed 64-bit integer, got seed={seed}", param="seed")
    given = [name for name in ("messages", "prompt", "prompt_token_ids") if getattr(request, name) is not None]
    if len(given) != 1:
        raise InvalidRequest(
            f"exactly one of messages, prompt, prompt_token_ids must be given, got {given or 'none'}",
            param=given[1] if len(given) > 1 else "messages",
        )
    for token_id in request.prompt_token_ids or ():
        if not 0 <= token_id < vocab_size:
            raise InvalidRequest(
                f"prompt_token_ids has {token_id}, outside the vocabulary [0, {vocab_size})",
                param="prompt_token_ids",
            )


def resolve_max_tokens(params: SamplingParams, prompt_len: int, max_model_len: int, param: str) -> SamplingParams:
    """Check the prompt (and the completion, when max_tokens was given) fits the context.

    ``param`` names the prompt field ("messages" or "prompt") in errors. Without
    max_tokens the completion may fill the context.
    """
    kind = "messages" if param == "messages" else "prompt"
    if prompt_len == 0:
        raise InvalidRequest(f"the {kind} resulted in an empty prompt", param=param)
    if prompt_len >= max_model_len:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, your {kind} "
            f"resulted in {prompt_len} tokens, leaving no room for the completion. "
            f"Please reduce the length of the {kind}.",
            param=param,
            code="context_length_exceeded",
        )
    if params.max_tokens == 0:
        max_tokens = max_model_len - prompt_len
        if params.min_tokens > max_tokens:
            raise InvalidRequest(
                f"min_tokens ({params.min_tokens}) exceeds the {max_tokens} tokens left in the context "
                f"({max_model_len} tokens, {prompt_len} in the {kind})",
                param="min_tokens",
            )
        return msgspec.structs.replace(params, max_tokens=max_tokens)
    if prompt_len + params.max_tokens > max_model_len:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + params.max_tokens} tokens ({prompt_len} in the {kind}, {params.max_tokens} "
            f"in the completion). Please reduce the length of the {kind} or completion.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return params
