"""Token-for-token comparison of our greedy output with Hugging Face's.

A difference is accepted only where the reference's top-two logits are within
``tie_tolerance`` of each other (a near tie, as vLLM's own tests allow); the
comparison of that prompt stops there. Any other difference fails.
"""

from __future__ import annotations


def assert_greedy_matches(ours: list[list[int]], refs, min_tokens: int, tie_tolerance: float = 1e-3) -> int:
    """``refs``: per prompt, (reference tokens, top-2 logit gaps per position).
    Returns the number of prompts that stopped early at a near tie."""
    near_ties = 0
    for i, (got, (want, gaps)) in enumerate(zip(ours, refs, strict=True)):
        assert len(got) >= min_tokens, f"prompt {i}: only {len(got)} tokens generated"
        n = min(len(got), len(want))
        for pos in range(n):
            if got[pos] != want[pos]:
                assert gaps[pos] < tie_tolerance, (
                    f"prompt {i}: token {pos} differs (ours {got[pos]}, HF {want[pos]}) and the "
                    f"reference's top-2 gap is {gaps[pos]:.2e}, not a near tie\n"
                    f"ours: {got}\nHF:   {want}"
                )
                near_ties += 1
                break
    return near_ties
