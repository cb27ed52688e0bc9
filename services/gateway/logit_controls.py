"""The logit-control request fields: OpenAI's ``logit_bias`` and vLLM's
``allowed_token_ids`` and ``bad_words``, read into ``SamplingParams`` settings.

Token ids are checked against the vocabulary by the tokenizer service
(``shared.logit_controls``), which also turns bad words into token sequences.
"""

from __future__ import annotations

import math

from .errors import invalid

# Each travels once to every worker rank: bounded.
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_ALLOWED_TOKEN_IDS = 1 << 16
# OpenAI's range; vLLM clamps a bias outside it into it.
MAX_BIAS = 100.0


def logit_controls(f) -> dict:
    """``logit_bias``, ``allowed_token_ids``, ``bad_words`` of the body (a ``Fields``)."""
    controls = {}
    if f.has("logit_bias"):
        controls["logit_bias"] = _logit_bias(f.raw("logit_bias"))
    if f.has("allowed_token_ids"):
        ids = f.int_list("allowed_token_ids")
        if len(ids) > MAX_ALLOWED_TOKEN_IDS:
            raise invalid(f"allowed_token_ids may hold at most {MAX_ALLOWED_TOKEN_IDS} ids",
                          param="allowed_token_ids")
        controls["allowed_token_ids"] = sorted(set(ids))
    if f.has("bad_words"):
        controls["bad_words"] = f.str_list("bad_words")
    return controls


def _logit_bias(value) -> dict[int, float]:
    param = "logit_bias"
    if not isinstance(value, dict):
        raise invalid("logit_bias must be an object mapping token ids to biases", param=param)
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise invalid(f"logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} entries", param=param)
    bias = {}
    for key, number in value.items():
        try:
            token_id = int(key)
        except ValueError:
            raise invalid(f"logit_bias keys must be token ids, got {key!r}", param=param) from None
        if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number):
            raise invalid(f"logit_bias values must be numbers, got {number!r} for {key}", param=param)
        if not 0 <= token_id < 2**31:
            raise invalid(f"logit_bias has token id {token_id}, outside the vocabulary", param=param)
        bias[token_id] = min(MAX_BIAS, max(-MAX_BIAS, float(number)))
    return bias
