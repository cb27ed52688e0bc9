"""The request's output text settings in the detokenizer, against ``tokenizer.decode``.

vLLM's meaning: ``stop_reason`` is the stop string that ended the text (or the stop
token id the scheduler reported); ``include_stop_str_in_output`` keeps the stop string
(and the stop token's text) in the text; ``skip_special_tokens=False`` keeps special
tokens' text; ``spaces_between_special_tokens=False`` puts nothing between consecutive
special tokens.
"""

from __future__ import annotations

import random

from shared.protocol import FinishReason, RequestStopStrings
from shared.token_window import BASE_WINDOW, window_tokens

from .test_incremental import STOPS, engine_output, stream


def settings(stop=(), **fields) -> RequestStopStrings:
    return RequestStopStrings("r", list(stop), **fields)


def random_stops(smollm_tokenizer, real_sequences, seed: int, trials: int = 20):
    """(rng, output tokens, its text, stop strings, the first stop string found or None)
    for random stop sets over the real sequences."""
    rng = random.Random(seed)
    for out in real_sequences:
        full = smollm_tokenizer.decode(out)
        for _ in range(trials):
            stop = rng.sample(STOPS, rng.randint(1, 3))
            hits = sorted((full.find(s), i, s) for i, s in enumerate(stop) if s in full)
            yield rng, out, full, stop, (hits[0][2] if hits else None)


def test_stop_reason_is_the_stop_string_that_matched_first(detok, smollm_tokenizer, real_sequences):
    checked = 0
    for rng, out, full, stop, first in random_stops(smollm_tokenizer, real_sequences, 11):
        _, final, _ = stream(detok, out, rng, stop=stop)
        assert final.stop_reason == first
        if first is None:
            assert final.finish_reason == FinishReason.LENGTH
        checked += first is not None
    assert checked > 20


def test_include_stop_str_in_output_keeps_the_stop_string_and_streams_prefixes(detok, smollm_tokenizer,
                                                                               real_sequences):
    checked = 0
    for rng, out, full, stop, first in random_stops(smollm_tokenizer, real_sequences, 12):
        deltas, final, late = stream(detok, out, rng, stop=stop,
                                     settings=settings(stop, include_stop_str_in_output=True))
        expected = full[:full.index(first) + len(first)] if first else full
        assert "".join(deltas) == expected
        for i in range(len(deltas)):
            assert expected.startswith("".join(deltas[: i + 1]))
        if first:
            checked += 1
            assert final.stopped and final.stop_reason == first
            assert all(r.already_stopped and r.text == "" for after, r in late if after <= 4)
    assert checked > 20


def test_the_stop_token_adds_no_text_unless_included(detok, smollm_tokenizer):
    encode = lambda text: smollm_tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    stop_token = encode(" world")[-1]
    out = encode("hello") + [stop_token]

    def text(finish, text_settings):
        results = []
        for n in range(1, len(out) + 1):
            output = engine_output(out, n, 1, 4, finish if n == len(out) else FinishReason.NONE)
            if n == len(out) and finish == FinishReason.STOP:
                output.stop_reason = stop_token
            results.append(detok.process(output, text_settings))
        return "".join(r.text for r in results), results[-1].stop_reason

    assert text(FinishReason.STOP, settings()) == ("hello", stop_token)
    assert text(FinishReason.STOP, settings(include_stop_str_in_output=True)) == ("hello world", stop_token)
    assert text(FinishReason.LENGTH, settings()) == ("hello world", None)


def test_special_tokens_are_kept_when_asked(detok, smollm_tokenizer, real_sequences):
    rng = random.Random(13)
    out = real_sequences[-1]  # holds EOS and two <|im_start|> in a row
    with_specials = smollm_tokenizer.decode(out, skip_special_tokens=False)
    assert "<|im_end|>" in with_specials and "<|im_start|><|im_start|>" in with_specials
    for spaces in (True, False):
        for window in (BASE_WINDOW, BASE_WINDOW + 1, 20):
            deltas, final, _ = stream(detok, out, rng, window=window,
                                      settings=settings(skip_special_tokens=False,
                                                        spaces_between_special_tokens=spaces))
            assert "".join(deltas) == with_specials
    # Skipped (the default) they leave nothing.
    deltas, _, _ = stream(detok, out, rng)
    assert "".join(deltas) == smollm_tokenizer.decode(out)


def test_no_space_between_consecutive_special_tokens(detok, smollm_tokenizer):
    im_start = smollm_tokenizer.backend.token_to_id("<|im_start|>")
    eos = smollm_tokenizer.eos_token_id
    out = [im_start, eos, im_start] + smollm_tokenizer.encode("hi", add_special_tokens=False) + [eos]
    text = detok.decode_window(out, settings(skip_special_tokens=False, spaces_between_special_tokens=False))
    assert text == "<|im_start|><|im_end|><|im_start|>hi<|im_end|>"


def test_stop_strings_match_special_token_text_when_kept(detok, smollm_tokenizer):
    """A stop string can only match text that is in the output: "<|im_end|>" with the
    special tokens kept."""
    eos = smollm_tokenizer.eos_token_id
    out = smollm_tokenizer.encode("a b", add_special_tokens=False) + [eos] + smollm_tokenizer.encode(
        " c", add_special_tokens=False)
    stop = ["<|im_end|>"]
    kept = settings(stop, skip_special_tokens=False)
    results = [detok.process(engine_output(out, n, 1, window_tokens(stop)), kept) for n in range(1, len(out) + 1)]
    assert "".join(r.text for r in results if not r.already_stopped) == "a b"
    assert any(r.stopped and r.stop_reason == "<|im_end|>" for r in results)
