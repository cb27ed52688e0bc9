"""Stateless incremental detokenization: one ``EngineOutput`` in, one text delta out.

Sits in the detokenizer service, between the scheduler (which publishes each step's
new token ids) and the gateway (which writes text to the client). It keeps no state
per request: every ``EngineOutput`` carries the request's recent output tokens (its
window, ending with the new tokens), and that is enough to produce the text of
exactly the new tokens, so any detokenizer replica can handle any step.

What the client sees after ``n`` output tokens is defined once, globally::

    clean(n)   = decode(output[:n]) without trailing U+FFFD   (an unfinished
                 UTF-8 character is emitted with the token that completes it)
                 cut before the first stop string, if one occurs
    emitted(n) = clean(n)                      if the request finished at n
                 clean(n)[: len(clean(n)) - H] otherwise (H = longest stop - 1:
                 no part of a stop string that may still complete is streamed)

and the delta of a step is ``emitted(n)`` minus ``emitted(n - len(new))``. The
request's text settings (``RequestStopStrings``, vLLM's meaning) change ``decode``
(``skip_special_tokens``, ``spaces_between_special_tokens``), drop the text of the EOS
or stop token that ended the request, and with ``include_stop_str_in_output`` cut after
the stop string instead of before it (then H = 0: nothing need be held back, since the
stop string is kept anyway). Both are
computed inside the window: its text and the global text agree after the window's
first whole character, so differences of positions measured from there are the
same. The window start may cut a character (its leading bytes then decode to
U+FFFD "garbage", counted and skipped) and must leave at least H characters of
text before the new tokens (``shared.token_window``)::

    window_token_ids:  [ prev tokens (k) ........................ | new tokens (m) ]
    window text:       [ garbage g | prev text ... [held back H] | new text ...... ]
                                                  ^ emitted up to here before
"""

from __future__ import annotations

import logging
import re

import msgspec

from shared.protocol import (
    EngineOutput,
    FinishReason,
    Logprobs,
    PromptLogprob,
    RequestStopStrings,
    TokenLogprob,
    TopLogprob,
)
from shared.token_window import holdback_chars
from shared.tokenizer import byte_alphabet

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"
DEFAULT_SETTINGS = RequestStopStrings("", [])
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class DetokenizedOutput(msgspec.Struct, gc=False):
    """The text of one ``EngineOutput``'s new tokens and what it means for the request.

    ``stopped``: a stop string ended the request in this step (the scheduler must be
    told to abort it). ``already_stopped``: a stop string ended it in an earlier step,
    so this output (tokens the scheduler made before the abort reached it) is dropped.
    """

    text: str
    finish_reason: FinishReason
    stopped: bool = False
    already_stopped: bool = False
    window_too_short: bool = False
    logprobs: list[TokenLogprob] = []
    # vLLM's stop_reason: the stop string that ended the request here, else the stop
    # token id the scheduler reported (None: EOS, length, still running).
    stop_reason: str | int | None = None
    prompt_logprobs: list[PromptLogprob] = []


class IncrementalDetokenizer:
    """Turns ``EngineOutput``s into text deltas with one tokenizer; no per-request state."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        backend = tokenizer.backend
        decoder = backend.decoder
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        self._added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
        self._unicode_to_byte = {c: b for b, c in byte_alphabet().items()}
        # Per-id token text and raw bytes for logprobs, filled lazily.
        self._token_text: dict[int, str] = {}
        self._token_bytes: dict[int, bytes] = {}

    # ------------------------------------------------------------------ text

    def decode_window(self, token_ids: list[int], settings: RequestStopStrings = DEFAULT_SETTINGS) -> str:
        """The text of ``token_ids`` under the request's settings. Without
        ``spaces_between_special_tokens`` (and keeping special tokens), consecutive added
        tokens are decoded apart, so no space the decoder would put between them remains
        (vLLM's fast detokenizer: a special token after a special token is its raw text)."""
        if settings.skip_special_tokens or settings.spaces_between_special_tokens:
            return self.tokenizer.decode(token_ids, skip_special_tokens=settings.skip_special_tokens)
        parts, start = [], 0
        for i in range(1, len(token_ids)):
            if token_ids[i] in self._added and token_ids[i - 1] in self._added:
                parts.append(token_ids[start:i])
                start = i
        parts.append(token_ids[start:])
        return "".join(self.tokenizer.decode(part, skip_special_tokens=False) for part in parts)

    def process(self, output: EngineOutput, settings: RequestStopStrings | None = None) -> DetokenizedOutput:
        """The text delta of ``output``'s new tokens (see the module docstring);
        ``settings``: the request's stop strings and text settings (None: the stop
        strings ``output`` carries, default settings)."""
        if settings is None:
            settings = output.text_settings or RequestStopStrings(output.request_id, output.stop)
        window = output.window_token_ids
        num_new = len(output.new_token_ids)
        num_prev = len(window) - num_new
        if num_prev < 0:
            raise ValueError(f"window of {len(window)} tokens does not hold the {num_new} new ones")
        stop = [s for s in settings.stop if s]
        holdback = holdback_chars(stop)
        if num_new == 0:
            # An error report without tokens: nothing to decode.
            logprobs = self.token_logprobs(output.logprobs, settings.return_tokens_as_token_ids)
            return DetokenizedOutput("", output.finish_reason, logprobs=logprobs, stop_reason=output.stop_reason)
        if output.finish_reason == FinishReason.STOP and not settings.include_stop_str_in_output:
            # vLLM: the EOS or stop token that ended the request adds no text.
            window = window[:-1]

        prev_full = self.decode_window(window[:num_prev], settings)
        cur_full = self.decode_window(window, settings)
        # Leading U+FFFD from bytes of a character that began before the window. Counting
        # a genuine U+FFFD after them too only shifts both texts alike.
        garbage = 0 if output.window_offset == 0 else _count_leading(cur_full, REPLACEMENT_CHAR)
        prev = prev_full.rstrip(REPLACEMENT_CHAR)[garbage:]
        cur = cur_full.rstrip(REPLACEMENT_CHAR)[garbage:]

        window_too_short = output.window_offset > 0 and len(prev) < holdback
        if window_too_short:
            logger.warning(
                "%s: detokenize window of %d tokens holds %d characters before the new tokens, "
                "%d needed for stop strings; text may be lost",
                output.request_id, len(window), len(prev), holdback,
            )

        finish_reason = output.finish_reason
        stop_reason = output.stop_reason
        stopped = False
        if stop:
            if _find_stop(prev, stop, 0) is not None:
                return DetokenizedOutput(
                    "", FinishReason.STOP, already_stopped=True, window_too_short=window_too_short
                )
            # Only a stop string that ends in the new text can be new.
            found = _find_stop(cur, stop, max(0, len(prev) - holdback))
            if found is not None:
                cut, stop_reason = found
                cur = cur[:cut + len(stop_reason)] if settings.include_stop_str_in_output else cur[:cut]
                finish_reason = FinishReason.STOP
                stopped = True

        # Text kept in the output anyway (include_stop_str_in_output) need not wait.
        held = 0 if settings.include_stop_str_in_output else holdback
        emitted_before = max(0, len(prev) - held)
        emitted_now = len(cur) if finish_reason != FinishReason.NONE else max(0, len(cur) - held)
        text = cur[emitted_before:emitted_now] if emitted_now > emitted_before else ""
        return DetokenizedOutput(
            text, finish_reason, stopped=stopped, window_too_short=window_too_short,
            logprobs=self.token_logprobs(output.logprobs, settings.return_tokens_as_token_ids),
            stop_reason=stop_reason,
            prompt_logprobs=self.prompt_logprobs(output.prompt_logprobs),
        )

    # ------------------------------------------------------------------ logprobs

    def token_logprobs(self, logprobs: list[Logprobs], as_token_ids: bool = False) -> list[TokenLogprob]:
        """OpenAI-shaped logprobs: the sampled token first, then its top alternatives.
        ``as_token_ids`` (vLLM's return_tokens_as_token_ids): each token is "token_id:<id>",
        its bytes that text's."""
        token = self._token_id_text if as_token_ids else self._token_text_and_bytes
        result = []
        for lp in logprobs:
            if not lp.token_ids:
                continue
            tops = []
            for t, v in zip(lp.token_ids[1:], lp.logprobs[1:]):
                text, raw = token(t)
                tops.append(TopLogprob(text, float(v), raw))
            text, raw = token(lp.token_ids[0])
            result.append(TokenLogprob(text, float(lp.logprobs[0]), raw, tops))
        return result

    def _token_text_and_bytes(self, token_id: int) -> tuple[str, list[int]]:
        return self.token_text(token_id), list(self.token_bytes(token_id))

    @staticmethod
    def _token_id_text(token_id: int) -> tuple[str, list[int]]:
        text = f"token_id:{token_id}"
        return text, list(text.encode())

    def prompt_logprobs(self, entries: list[Logprobs]) -> list[PromptLogprob]:
        """Prompt logprobs with each token's text (vLLM's ``decoded_token``)."""
        return [PromptLogprob(lp.token_ids, lp.logprobs, lp.sampled_rank, [self.token_text(t) for t in lp.token_ids])
                for lp in entries]

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (part of a character for some tokens)."""
        raw = self._token_bytes.get(token_id)
        if raw is None:
            raw = self._raw_bytes(token_id)
            self._token_bytes[token_id] = raw
        return raw

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.token_bytes(token_id).decode("utf-8", errors="replace")
            self._token_text[token_id] = text
        return text

    def _raw_bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode("utf-8")
        token = self.tokenizer.backend.id_to_token(token_id)
        if token is None:
            return b""
        if self._byte_level and all(c in self._unicode_to_byte for c in token):
            return bytes(self._unicode_to_byte[c] for c in token)
        match = _BYTE_TOKEN.fullmatch(token)
        if match:  # SentencePiece byte fallback
            return bytes([int(match.group(1), 16)])
        if not self._byte_level:  # SentencePiece: "▁" is a space
            return token.replace("\u2581", " ").encode("utf-8")
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")


def _count_leading(text: str, char: str) -> int:
    return len(text) - len(text.lstrip(char))


def _find_stop(text: str, stop: list[str], start: int) -> tuple[int, str] | None:
    """The earliest stop string occurrence in ``text[start:]`` (its index and the stop
    string; the first listed of those starting there), or None."""
    best = None
    for s in stop:
        i = text.find(s, start)
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    return best

