"""The tokenizer service's settings: one frozen dataclass, filled from flags (``__main__``)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import (
    check_max_model_len,
    max_model_len_setting,
    model_setting,
    setting,
    structured_outputs_warmup_setting,
)


@dataclass(frozen=True)
class TokenizerConfig:
    model: str = model_setting()
    # Prompts are checked against the model's context length capped by this.
    max_model_len: int | None = max_model_len_setting()
    scheduler_timeout: float = setting(5.0, "seconds to wait for a scheduler to take a request")
    special_tokens_in_content: bool = setting(
        False, "special-token texts typed in chat message contents become control tokens (default: plain text)")
    chat_template: str = setting(
        "", "chat template (a Jinja file, or the template itself) used instead of the model's ('' = the model's)")
    structured_outputs_warmup: bool = structured_outputs_warmup_setting()

    def __post_init__(self) -> None:
        check_max_model_len(self.max_model_len)
