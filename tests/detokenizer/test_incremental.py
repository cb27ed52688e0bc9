"""Stateless incremental detokenization against ``tokenizer.decode`` of the whole output.

Outputs are fed the way the scheduler builds them (a window of recent output tokens
ending with the new ones), one to three tokens per step, with the default model's
byte-level BPE tokenizer: characters split over several tokens (emoji, CJK), special
tokens in the text, windows that start in the middle of a character, stop strings.
"""

from __future__ import annotations

import random

from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from shared.config import CacheConfig, SchedulerConfig
from shared.protocol import EngineOutput, FinishReason, Logprobs, RequestStopStrings, SamplingParams
from shared.token_window import BASE_WINDOW, window_tokens

from .conftest import TEXTS

STOPS = ["\n\n", "done", "😀👍", "世界", "ok", ". ", "終わり", "🐍\n", "∫√", "Ελλ", "zzz", "f(3)"]


def engine_output(out, n, num_new, window, finish=FinishReason.NONE, stop=(), logprobs=()):
    """What ``Scheduler._engine_output`` sends after ``n`` output tokens, the last
    ``num_new`` of them new, with ``window`` tokens before the new ones."""
    start = max(0, n - num_new - window)
    return EngineOutput(
        request_id="r", gateway_id="g", new_token_ids=out[n - num_new:n], window_token_ids=out[start:n],
        window_offset=start, num_prompt_tokens=3, finish_reason=finish, logprobs=list(logprobs), stop=list(stop),
    )


def stream(detok, out, rng, stop=(), window=None, finish=FinishReason.LENGTH, make_output=None, settings=None):
    """Feed ``out`` in steps of 1-3 tokens: (deltas, the result that finished the stream,
    [(tokens after the finish, result)] for outputs made before the abort took effect).
    ``settings``: the request's text settings (default: its stop strings only)."""
    settings = settings or RequestStopStrings("r", list(stop))
    window = window_tokens(list(stop)) if window is None else window
    make_output = make_output or (lambda n, k, reason: engine_output(out, n, k, window, reason, stop))
    deltas, final, late = [], None, []
    n = finished_at = 0
    while n < len(out):
        k = min(rng.randint(1, 3), len(out) - n)
        n += k
        # The stop strings as the service gives them (from the output or its cache).
        result = detok.process(make_output(n, k, finish if n == len(out) else FinishReason.NONE), settings)
        assert not result.window_too_short
        if final is not None:
            late.append((n - finished_at, result))
            continue
        deltas.append(result.text)
        if result.finish_reason != FinishReason.NONE:
            final, finished_at = result, n
    return deltas, final, late


def test_real_text_streams_exactly_the_decoded_text(detok, smollm_tokenizer, real_sequences):
    rng = random.Random(1)
    for out in real_sequences:
        expected = smollm_tokenizer.decode(out)
        for window in (BASE_WINDOW, BASE_WINDOW + 1, 20):
            for _ in range(10):
                deltas, final, _ = stream(detok, out, rng, window=window)
                assert "".join(deltas) == expected
                assert final.finish_reason == FinishReason.LENGTH
                assert not any("\ufffd" in d for d in deltas)
                assert "<|im_end|>" not in expected and "<|im_start|>" not in expected


def test_partial_characters_wait_for_the_token_that_completes_them(detok, smollm_tokenizer):
    out = smollm_tokenizer.encode(" 😀", add_special_tokens=False)
    assert len(out) >= 2  # the emoji's four bytes span tokens
    deltas = [detok.process(engine_output(out, n, 1, BASE_WINDOW)).text for n in range(1, len(out) + 1)]
    assert deltas[-1].endswith("😀") and "".join(deltas) == " 😀"
    assert "😀" not in "".join(deltas[:-1])


def test_random_tokens_match_decode(detok, smollm_tokenizer):
    """Arbitrary ids, many of them single bytes: invalid UTF-8 inside the text too."""
    rng = random.Random(2)
    vocab = smollm_tokenizer.vocab_size
    single_bytes = [i for i in range(vocab) if len(detok.token_bytes(i)) == 1]
    assert len(single_bytes) == 256 - 21 or len(single_bytes) >= 200
    for trial in range(300):
        pick_byte = rng.random()
        out = [rng.choice(single_bytes) if rng.random() < pick_byte else rng.randrange(vocab)
               for _ in range(rng.randint(1, 40))]
        deltas, final, _ = stream(detok, out, rng, window=BASE_WINDOW)
        # An unfinished character at the very end is never emitted.
        assert "".join(deltas) == smollm_tokenizer.decode(out).rstrip("\ufffd"), out


def test_stop_strings_cut_hold_back_and_abort(detok, smollm_tokenizer, real_sequences):
    rng = random.Random(3)
    checked_stops = 0
    for out in real_sequences:
        full = smollm_tokenizer.decode(out)
        for _ in range(40):
            stop = rng.sample(STOPS, rng.randint(1, 3))
            deltas, final, late = stream(detok, out, rng, stop=stop)
            hits = [full.find(s) for s in stop if s in full]
            expected = full[:min(hits)] if hits else full
            assert "".join(deltas) == expected
            # Held back: what was streamed is always a prefix of the final text, so no
            # part of the stop string that completed ever reached the client.
            for i in range(len(deltas)):
                assert expected.startswith("".join(deltas[: i + 1]))
            if hits:
                checked_stops += 1
                assert final.finish_reason == FinishReason.STOP and final.stopped
                # Outputs the scheduler makes before the abort reaches it are dropped (the
                # window still shows the stop string for a few tokens; later, the gateway
                # ignores anything after a finished delta).
                for after, r in late:
                    if after <= 4:
                        assert r.already_stopped and r.text == ""
            else:
                assert final.finish_reason == FinishReason.LENGTH and not final.stopped
    assert checked_stops > 50


def test_tokens_after_a_stop_string_are_dropped(detok, smollm_tokenizer):
    out = smollm_tokenizer.encode("one two\n\nthree four five six", add_special_tokens=False)
    stop = ["\n\n"]
    results = [detok.process(engine_output(out, n, 1, window_tokens(stop), stop=stop)) for n in range(1, len(out) + 1)]
    stopped_at = next(i for i, r in enumerate(results) if r.stopped)
    assert "".join(r.text for r in results[: stopped_at + 1]) == "one two"
    assert results[stopped_at].finish_reason == FinishReason.STOP
    for r in results[stopped_at + 1:]:
        assert r.already_stopped and r.text == "" and not r.stopped


def test_finish_flushes_what_was_held_back(detok, smollm_tokenizer):
    out = smollm_tokenizer.encode("abc xyz", add_special_tokens=False)
    stop = ["xyz!!"]  # never completes; its prefix "xyz" ends the text
    texts = [detok.process(engine_output(out, n, 1, window_tokens(stop), stop=stop)).text for n in range(1, len(out))]
    assert "x" not in "".join(texts)
    last = detok.process(engine_output(out, len(out), 1, window_tokens(stop), FinishReason.LENGTH, stop))
    assert "".join(texts) + last.text == "abc xyz" and last.finish_reason == FinishReason.LENGTH


def test_eos_is_never_shown(detok, smollm_tokenizer):
    out = smollm_tokenizer.encode("Hi there", add_special_tokens=False) + [smollm_tokenizer.eos_token_id]
    deltas, final, _ = stream(detok, out, random.Random(4), finish=FinishReason.STOP)
    assert "".join(deltas) == "Hi there" and final.finish_reason == FinishReason.STOP and not final.stopped


def test_short_window_is_reported(detok, smollm_tokenizer):
    out = smollm_tokenizer.encode("a b c d e f g h i j k l m n o p", add_special_tokens=False)
    result = detok.process(engine_output(out, len(out), 1, 2, stop=["0123456789"]))
    assert result.window_too_short


def test_with_the_schedulers_own_windows(detok, smollm_tokenizer, real_sequences):
    """The scheduler's ``_engine_output`` builds windows the detokenizer can use."""
    sched = Scheduler(SchedulerConfig(), CacheConfig(block_size=16, num_gpu_blocks=64), 64, 4096)
    rng = random.Random(5)
    for stop in ([], ["zzz"], ["\n\n", "終わり"]):
        probe = Request("p", [5], SamplingParams(stop=stop, max_tokens=1000))
        for _ in range(100):
            probe.append_output_token(9)
        window = len(sched._engine_output(probe, [9], []).window_token_ids) - 1
        assert window >= window_tokens(stop), (
            f"the scheduler sends {window} tokens before the new ones with stop={stop}; "
            f"the detokenizer needs shared.token_window.window_tokens(stop) = {window_tokens(stop)}"
        )
        for out in real_sequences:
            request = Request("r", [5, 6, 7], SamplingParams(stop=stop, max_tokens=1000), gateway_id="g")

            def make_output(n, k, reason, request=request, out=out):
                for token_id in out[request.num_output_tokens:n]:
                    request.append_output_token(token_id)
                request.finish_reason = reason
                output = sched._engine_output(request, out[n - k:n], [])
                # Step outputs only flag stop strings; the detokenizer has them from the broadcast.
                assert output.stop == [] and output.has_stop == bool(stop)
                return output

            full = smollm_tokenizer.decode(out)
            hits = [full.find(s) for s in stop if s in full]
            deltas, final, _ = stream(detok, out, rng, stop=stop, make_output=make_output)
            assert "".join(deltas) == (full[:min(hits)] if hits else full)


def test_logprobs_carry_token_text_and_raw_bytes(detok, smollm_tokenizer):
    out = smollm_tokenizer.encode("a 😀你", add_special_tokens=False)
    assert b"".join(detok.token_bytes(t) for t in out) == "a 😀你".encode()
    eos = smollm_tokenizer.eos_token_id
    lp = Logprobs(token_ids=[out[1], out[0], eos], logprobs=[-0.5, -1.5, -2.5], sampled_rank=1)
    result = detok.process(engine_output(out, 2, 1, BASE_WINDOW, logprobs=[lp]))
    [token] = result.logprobs
    assert token.bytes == list(detok.token_bytes(out[1])) and token.logprob == -0.5
    assert token.token == detok.token_bytes(out[1]).decode("utf-8", errors="replace")
    assert [t.token for t in token.top_logprobs] == ["a", "<|im_end|>"]
    assert [t.logprob for t in token.top_logprobs] == [-1.5, -2.5]
    assert token.top_logprobs[1].bytes == list(b"<|im_end|>")
    for token_id in smollm_tokenizer.encode(TEXTS[0], add_special_tokens=False):
        text = smollm_tokenizer.decode([token_id])
        if "\ufffd" not in text:
            assert detok.token_bytes(token_id) == text.encode()
    # vLLM's return_tokens_as_token_ids: "token_id:<id>" and that text's bytes, the text unchanged.
    as_ids = RequestStopStrings("r", [], return_tokens_as_token_ids=True)
    same = detok.process(engine_output(out, 2, 1, BASE_WINDOW, logprobs=[lp]), as_ids)
    assert same.text == result.text
    [token] = same.logprobs
    name = f"token_id:{out[1]}"
    assert (token.token, token.bytes, token.logprob) == (name, list(name.encode()), -0.5)
    assert [(t.token, t.logprob) for t in token.top_logprobs] == [(f"token_id:{out[0]}", -1.5),
                                                                  (f"token_id:{eos}", -2.5)]
