"""Requests' logit controls applied to one step's logits, batched: ``logit_bias``,
``allowed_token_ids`` and ``bad_words``.

Applied by the sampler after the raw logprobs are taken and before penalties,
temperature, top-k/top-p (vLLM's order: they are logits processors; logprobs are of
the model's distribution as masked by a grammar, not of these). A bad word's last
token is banned when the output so far ends with the rest of the word.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def has_logit_controls(params) -> bool:
    return bool(params.logit_bias) or params.allowed_token_ids is not None or bool(params.bad_words_token_ids)


@dataclass
class LogitControls:
    """One step's controls; row numbers are the sampled logits' rows."""

    bias_rows: list[int]
    bias_token_ids: list[int]
    bias_values: list[float]
    allowed_rows: list[int]
    allowed_token_ids: list[list[int]]
    banned_rows: list[int]
    banned_token_ids: list[int]

    @classmethod
    def for_rows(cls, states_by_position: dict[int, object]) -> LogitControls | None:
        """The controls of the requests sampled at these logits rows (None: none apply)."""
        controls = cls([], [], [], [], [], [], [])
        for position, state in states_by_position.items():
            params = state.sampling_params
            for token_id, bias in params.logit_bias.items():
                controls.bias_rows.append(position)
                controls.bias_token_ids.append(token_id)
                controls.bias_values.append(bias)
            if params.allowed_token_ids is not None:
                controls.allowed_rows.append(position)
                controls.allowed_token_ids.append(params.allowed_token_ids)
            for token_id in banned_by_bad_words(params.bad_words_token_ids, state.output_token_ids):
                controls.banned_rows.append(position)
                controls.banned_token_ids.append(token_id)
        if not (controls.bias_rows or controls.allowed_rows or controls.banned_rows):
            return None
        return controls

    def moved_to(self, new_rows: list[int]) -> LogitControls:
        """The same controls on other logits rows: row r becomes ``new_rows[r]``."""
        return LogitControls(
            [new_rows[r] for r in self.bias_rows], self.bias_token_ids, self.bias_values,
            [new_rows[r] for r in self.allowed_rows], self.allowed_token_ids,
            [new_rows[r] for r in self.banned_rows], self.banned_token_ids,
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (already a copy the sampler owns) with the controls applied in place."""
        device = logits.device
        if self.allowed_rows:
            keep = torch.zeros(len(self.allowed_rows), logits.shape[1], dtype=torch.bool)
            for i, token_ids in enumerate(self.allowed_token_ids):
                keep[i, token_ids] = True
            rows = torch.tensor(self.allowed_rows, device=device)
            logits[rows] = logits[rows].masked_fill(~keep.to(device), float("-inf"))
        if self.bias_rows:
            logits.index_put_(
                (torch.tensor(self.bias_rows, device=device), torch.tensor(self.bias_token_ids, device=device)),
                torch.tensor(self.bias_values, dtype=logits.dtype, device=device),
                accumulate=True,
            )
        if self.banned_rows:
            logits[self.banned_rows, self.banned_token_ids] = float("-inf")
        return logits


def banned_by_bad_words(bad_words_token_ids: list[list[int]], output_token_ids: list[int]) -> list[int]:
    """The last token of each bad word whose other tokens end the output."""
    banned = []
    for word in bad_words_token_ids:
        prefix = word[:-1]
        if len(prefix) <= len(output_token_ids) and output_token_ids[len(output_token_ids) - len(prefix):] == prefix:
            banned.append(word[-1])
    return banned
