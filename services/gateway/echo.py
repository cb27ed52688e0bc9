"""``echo`` on completions (vLLM's): the prompt's text before the completion's.

The prompt text is the prompt string as given (the gateway has it; a token-id prompt is
refused with echo, as the gateway holds no tokenizer). With ``logprobs``, the prompt's
tokens lead the logprobs, from the prompt logprobs the workers computed (the
request asks for as many top-n as ``logprobs``): the first prompt token has null
``token_logprobs`` and ``top_logprobs`` (nothing predicts it), as in vLLM.
"""

from __future__ import annotations

import msgspec

from shared.protocol import PromptLogprob, SamplingParams

from .errors import invalid

MIN_LOGPROB = -9999.0


def echo_params(prompts: list[dict], params: SamplingParams) -> SamplingParams:
    """The sampling params of an echoing request: prompt logprobs for its logprobs (vLLM:
    as many top-n as ``logprobs`` unless ``prompt_logprobs`` says otherwise)."""
    if any("prompt" not in p for p in prompts):
        raise invalid("echo needs a text prompt on this server (not token ids)", param="echo")
    if params.logprobs is not None and params.prompt_logprobs is None:
        return msgspec.structs.replace(params, prompt_logprobs=params.logprobs)
    return params


def echo_logprobs(entries: list[PromptLogprob]) -> dict:
    """The prompt's part of a completion's logprobs (offsets from the prompt's start)."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    offset = 0
    for entry in entries:
        token = entry.decoded[0]
        tokens.append(token)
        text_offset.append(offset)
        offset += len(token)
        if not entry.logprobs:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(max(entry.logprobs[0], MIN_LOGPROB))
        tops = {text: max(value, MIN_LOGPROB) for text, value in zip(entry.decoded[1:], entry.logprobs[1:])}
        tops.setdefault(token, max(entry.logprobs[0], MIN_LOGPROB))
        top_logprobs.append(tops)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": text_offset}


def with_echo(prompt_part: dict, completion_part: dict | None) -> dict:
    """The two parts of the logprobs, prompt first (``completion_part``'s offsets
    already count from the start of the echoed text)."""
    if completion_part is None:
        return prompt_part
    return {key: prompt_part[key] + completion_part[key] for key in prompt_part}
