"""``truncate_prompt_tokens`` (vLLM's): keep only the last k tokens of the prompt (or, with
``truncation_side: "right"``, the first k).

The tokenizer service applies it to the prompt's ids (text, chat or token ids alike)
before the context check, so a long prompt can still run. ``-1`` means the model's
``max_model_len``; any other value must be at least 1, and no more than
``max_model_len`` (vLLM refuses a larger size rather than ignoring it). The gateway
checks the form (an integer, -1 or >= 1); this module the bound it cannot know.
"""

from __future__ import annotations

from shared.request_validation import InvalidRequest

PARAM = "truncate_prompt_tokens"
SIDE_PARAM = "truncation_side"
SIDES = ("left", "right")
TO_MAX_MODEL_LEN = -1


def check_form(truncate_prompt_tokens: int | None) -> None:
    """None, -1 or at least 1 (what the gateway can check without knowing the model)."""
    if truncate_prompt_tokens is not None and truncate_prompt_tokens != TO_MAX_MODEL_LEN \
            and truncate_prompt_tokens < 1:
        raise InvalidRequest(f"{PARAM} must be an integer >= 1 or -1, got {truncate_prompt_tokens}", param=PARAM)


def truncation_size(truncate_prompt_tokens: int | None, max_model_len: int) -> int | None:
    """How many prompt tokens to keep at most (None: all)."""
    if truncate_prompt_tokens is None:
        return None
    check_form(truncate_prompt_tokens)
    if truncate_prompt_tokens == TO_MAX_MODEL_LEN:
        return max_model_len
    if truncate_prompt_tokens > max_model_len:
        raise InvalidRequest(
            f"{PARAM} ({truncate_prompt_tokens}) is greater than max_model_len ({max_model_len}); "
            f"choose a smaller truncation size",
            param=PARAM,
        )
    return truncate_prompt_tokens


def check_side(side: str) -> None:
    """``truncation_side``: "left" (cut the start, vLLM's default) or "right" (cut the end)."""
    if side not in SIDES:
        raise InvalidRequest(f"{SIDE_PARAM} must be 'left' or 'right', got {side!r}", param=SIDE_PARAM)


def truncate_prompt(prompt_token_ids: list[int], truncate_prompt_tokens: int | None,
                    max_model_len: int, side: str = "left") -> list[int]:
    """The last ``truncation_size`` ids of the prompt (``side`` "left", vLLM's default), or
    the first ("right")."""
    check_side(side)
    size = truncation_size(truncate_prompt_tokens, max_model_len)
    if size is None or len(prompt_token_ids) <= size:
        return prompt_token_ids
    return prompt_token_ids[-size:] if side == "left" else prompt_token_ids[:size]
