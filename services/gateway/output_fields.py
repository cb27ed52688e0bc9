"""vLLM's request fields about the output text and the prompt, read at the edge.

``include_stop_str_in_output``, ``skip_special_tokens`` and
``spaces_between_special_tokens`` go into ``SamplingParams`` as they are (the
detokenizers apply them, see ``services/detokenizer/incremental.py``).
"""

from __future__ import annotations

from shared.protocol import SamplingParams

_DEFAULTS = SamplingParams()
_TEXT_SETTINGS = ("include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens")


def output_text_settings(f) -> dict:
    """The text settings given (booleans; absent or null: vLLM's defaults)."""
    return {name: f.bool(name, getattr(_DEFAULTS, name)) for name in _TEXT_SETTINGS}
