"""The token window rule the scheduler and the detokenizer share."""

from __future__ import annotations

from shared.token_window import BASE_WINDOW, holdback_chars, window_tokens


def test_window_tokens_cover_the_holdback():
    assert holdback_chars([]) == 0 and window_tokens([]) == BASE_WINDOW
    assert holdback_chars(["ab", "wxyz"]) == 3
    assert window_tokens(["ab", "wxyz"]) == BASE_WINDOW + 4 * 3
