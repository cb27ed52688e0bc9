"""Logit controls of a request, checked and prepared by the tokenizer service:
``logit_bias`` (token id -> bias), ``allowed_token_ids`` and ``bad_words``.

The gateway reads the fields (clamping each bias into [-100, 100], as vLLM does);
here the token ids are checked against the vocabulary and each bad word becomes the
token sequences that spell it (as the word starts the text, and after a space, as
vLLM does). Workers apply them in the sampler (``services/worker/logit_controls.py``).
"""

from __future__ import annotations

import msgspec

from shared.protocol import SamplingParams
from shared.request_validation import InvalidRequest

MAX_BAD_WORDS = 128


def prepare_logit_controls(params: SamplingParams, tokenizer, vocab_size: int) -> SamplingParams:
    """``params`` checked, with ``bad_words_token_ids`` filled; raises ``InvalidRequest``."""
    outside = sorted(t for t in params.logit_bias if not 0 <= t < vocab_size)
    if outside:
        raise InvalidRequest(f"logit_bias has token ids outside the vocabulary [0, {vocab_size}): {outside[:8]}",
                             param="logit_bias")
    if params.allowed_token_ids is not None:
        if not params.allowed_token_ids:
            raise InvalidRequest("allowed_token_ids must not be empty", param="allowed_token_ids")
        outside = sorted(t for t in params.allowed_token_ids if not 0 <= t < vocab_size)
        if outside:
            raise InvalidRequest(f"allowed_token_ids has token ids outside the vocabulary [0, {vocab_size}): "
                                 f"{outside[:8]}", param="allowed_token_ids")
    if not params.bad_words:
        return params
    if len(params.bad_words) > MAX_BAD_WORDS:
        raise InvalidRequest(f"bad_words may hold at most {MAX_BAD_WORDS} words", param="bad_words")
    if tokenizer is None:
        raise InvalidRequest("bad_words need the model's tokenizer", param="bad_words")
    return msgspec.structs.replace(params, bad_words_token_ids=bad_words_token_ids(params.bad_words, tokenizer))


def bad_words_token_ids(bad_words: list[str], tokenizer) -> list[list[int]]:
    """Each word's token ids as it starts the text, and as it follows a space (a
    byte-level BPE spells " word" with other tokens)."""
    sequences: list[list[int]] = []
    for word in bad_words:
        word = word.strip()
        if not word:
            raise InvalidRequest("bad_words must not be empty or blank", param="bad_words")
        plain = tokenizer.encode(word, add_special_tokens=False)
        spaced = tokenizer.encode(" " + word, add_special_tokens=False)
        for ids in (plain, spaced):
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences
