"""vLLM's request fields about the output text and the prompt, read at the edge.

``include_stop_str_in_output``, ``skip_special_tokens``,
``spaces_between_special_tokens`` and ``return_tokens_as_token_ids`` go into
``SamplingParams`` as they are (the detokenizers apply them, see
``services/detokenizer/incremental.py``), and so does
``truncate_prompt_tokens`` (-1 or >= 1 here; the tokenizer checks it against
max_model_len and applies it, ``shared/prompt_truncation.py``) and ``prompt_logprobs``
(the workers compute them, ``services/worker/prompt_logprobs.py``).
"""

from __future__ import annotations

from shared.prompt_truncation import PARAM as TRUNCATE, check_form
from shared.protocol import SamplingParams
from shared.request_validation import MAX_LOGPROBS, InvalidRequest

from .errors import ApiError, invalid

_DEFAULTS = SamplingParams()
_TEXT_SETTINGS = ("include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens",
                  "return_tokens_as_token_ids")


def output_text_settings(f) -> dict:
    """The text settings given (booleans; absent or null: vLLM's defaults)."""
    return {name: f.bool(name, getattr(_DEFAULTS, name)) for name in _TEXT_SETTINGS}


def prompt_settings(f) -> dict:
    """``truncate_prompt_tokens``: absent/null, -1 (to max_model_len) or at least 1."""
    size = f.int(TRUNCATE, None)
    try:
        check_form(size)
    except InvalidRequest as e:
        raise ApiError.from_info(e.error) from e
    return {TRUNCATE: size}


def prompt_logprobs(f) -> int | None:
    """vLLM's ``prompt_logprobs``: the top-n per prompt position, in [0, MAX_LOGPROBS];
    not when streaming (as vLLM), and not -1 (the whole vocabulary)."""
    n = f.int("prompt_logprobs", None)
    if n is None:
        return None
    if f.raw("stream", False) is True:
        raise invalid("prompt_logprobs are not available when stream is true", param="prompt_logprobs")
    if not 0 <= n <= MAX_LOGPROBS:
        raise invalid(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {n}", param="prompt_logprobs")
    return n
