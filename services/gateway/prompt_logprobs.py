"""vLLM's ``prompt_logprobs`` in a response: one entry per prompt token, null for the first.

Each entry maps a token id (a JSON string key) to ``{"logprob", "rank",
"decoded_token"}``: the prompt token itself (with its rank in the model's
distribution) and the top-n at that position (ranks 1..n). Completions put the list in
each choice, chat at the top of the response (its one prompt), as vLLM does. ``-inf``
is clamped to -9999.0. Not available when streaming (vLLM refuses it too).
"""

from __future__ import annotations

from shared.protocol import PromptLogprob

MIN_LOGPROB = -9999.0


def prompt_logprobs_json(entries: list[PromptLogprob]) -> list[dict | None]:
    result: list[dict | None] = []
    for entry in entries:
        if not entry.logprobs:
            result.append(None)  # the first prompt token: nothing predicts it
            continue
        position: dict[str, dict] = {}
        ranks = [entry.rank] + list(range(1, len(entry.token_ids)))
        for token_id, logprob, rank, text in zip(entry.token_ids, entry.logprobs, ranks, entry.decoded):
            position.setdefault(str(token_id), {"logprob": max(logprob, MIN_LOGPROB), "rank": rank,
                                                "decoded_token": text})
        result.append(position)
    return result
