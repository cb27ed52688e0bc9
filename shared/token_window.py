"""The token window: how many recent output tokens each ``EngineOutput`` carries.

A contract between the scheduler, which cuts ``EngineOutput.window_token_ids``, and
the stateless detokenizer, which reads the text of the new tokens out of it. The
detokenizer holds back from a running stream the characters that may still turn
into a stop string (``holdback_chars``) and re-reads them in the next step, so the
window must reach that far back in tokens (``window_tokens``).
"""

from __future__ import annotations

# Previous tokens the window needs without stop strings: an unfinished character at
# the window start (up to 3 tokens of continuation bytes), one at the end (up to 3),
# and at least one whole character between them.
BASE_WINDOW = 8
# UTF-8 bytes per character, at most; every non-special token carries >= 1 byte.
MAX_BYTES_PER_CHAR = 4


def holdback_chars(stop: list[str]) -> int:
    """Characters held back from a running stream: a stop string's longest proper prefix."""
    return max((len(s) for s in stop), default=1) - 1


def window_tokens(stop: list[str]) -> int:
    """Output tokens the scheduler must send before the new ones for these stop strings.

    The detokenizer holds back and re-reads up to ``H = longest stop - 1`` characters of
    text before the new tokens; each character is at most 4 UTF-8 bytes and each
    (non-special) token at least one byte, so ``4 * H`` tokens cover them, on top of
    ``BASE_WINDOW`` for the unfinished characters at both ends.
    """
    return BASE_WINDOW + MAX_BYTES_PER_CHAR * holdback_chars(stop)
