"""vLLM's request fields about the output text and the prompt, read at the edge.

``include_stop_str_in_output``, ``skip_special_tokens`` and
``spaces_between_special_tokens`` go into ``SamplingParams`` as they are (the
detokenizers apply them, see ``services/detokenizer/incremental.py``), and so does
``truncate_prompt_tokens`` (-1 or >= 1 here; the tokenizer checks it against
max_model_len and applies it, ``shared/prompt_truncation.py``).
"""

from __future__ import annotations

from shared.prompt_truncation import PARAM as TRUNCATE, check_form
from shared.protocol import SamplingParams
from shared.request_validation import InvalidRequest

from .errors import ApiError

_DEFAULTS = SamplingParams()
_TEXT_SETTINGS = ("include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens")


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
