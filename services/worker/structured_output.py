"""Structured output on a worker rank: a grammar matcher per request, the batch's logits masked.

Every rank keeps, in each constrained request's ``CachedRequestState``, a
``RequestGrammar``: the compile of its spec (started in a thread when the request's
new-request data arrives, from this rank's compile cache) and then its matcher. The
matcher is advanced with the tokens the rank samples itself, exactly as the request's
token ids are, so all ranks hold the same state and no bitmask crosses the bus.

* Async scheduling needs nothing more: a worker runs its steps in order, so when it
  masks step N+1 it has already accepted step N's token.
* Preemption keeps the request's state on the workers (only its blocks change) and
  recomputing samples nothing new, so the matcher stays valid. A request resumed on a
  restarted worker arrives with its output tokens, which the new matcher replays.
* A request whose grammar is still compiling when its first token is due is waited
  for, up to ``GRAMMAR_WAIT_S`` (compiles take milliseconds, and the tokenizer has
  already compiled the same spec once to validate it; the wait overlaps the prompt's
  prefill). docs/ARCHITECTURE.md says why the scheduler does not hold it instead.
* When the grammar is complete only the stop tokens (the request's EOS) are allowed,
  so the scheduler's EOS check finishes the request. A token sampled after that (one
  computed in vain under async scheduling, which the scheduler drops) is left alone.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future

import torch

from shared.protocol import SamplingParams
from shared.structured_output import (
    GrammarCompileCache,
    GrammarMatcher,
    TokenizerVocabulary,
    grammar_spec,
    make_backend,
)

logger = logging.getLogger(__name__)

# How long a step waits for a grammar still compiling when its request's first token is due.
GRAMMAR_WAIT_S = 60.0


class RequestGrammar:
    """One request's grammar on this rank: the compile in flight, then its matcher."""

    __slots__ = ("compiled", "stop_token_ids", "matcher", "broken")

    def __init__(self, compiled: Future, stop_token_ids: list[int]) -> None:
        self.compiled = compiled
        self.stop_token_ids = stop_token_ids
        self.matcher: GrammarMatcher | None = None
        # A token the matcher refused (never expected): the request goes on unconstrained.
        self.broken = False

    def ready_matcher(self, cache: GrammarCompileCache, output_token_ids: list[int]) -> GrammarMatcher:
        """The matcher, made on first use once the grammar is compiled (waiting for it up
        to ``GRAMMAR_WAIT_S``), with the tokens already generated replayed."""
        if self.matcher is None:
            compiled = self.compiled.result(timeout=GRAMMAR_WAIT_S)
            matcher = cache.backend.matcher(compiled, self.stop_token_ids)
            for token_id in output_token_ids:
                if not matcher.accept_token(token_id):
                    self.broken = True
                    break
            self.matcher = matcher
        return self.matcher


class StructuredOutputRunner:
    """The worker's grammars: compiles, the batch bitmask, masking and advancing."""

    def __init__(self, model_path: str, vocab_size: int, max_num_reqs: int) -> None:
        self.vocab_size = vocab_size
        self.max_num_reqs = max_num_reqs
        self.cache = GrammarCompileCache(lambda: make_backend(self._vocabulary(model_path)))
        self._bitmask: torch.Tensor | None = None

    def _vocabulary(self, model_path: str) -> TokenizerVocabulary:
        from shared.tokenizer import load_tokenizer

        return TokenizerVocabulary.from_tokenizer(load_tokenizer(model_path), self.vocab_size)

    def request_grammar(self, params: SamplingParams, eos_token_id: int | None) -> RequestGrammar | None:
        """Start compiling a new request's constraint (None: unconstrained)."""
        if params.structured_outputs is None:
            return None
        spec = grammar_spec(params.structured_outputs)
        return RequestGrammar(self.cache.get(spec), [eos_token_id] if eos_token_id is not None else [])

    def mask_logits(self, logits: torch.Tensor, states: list) -> None:
        """Mask row i of ``logits`` with the grammar of ``states[i]`` (rows of
        unconstrained requests, and of finished grammars, are left as they are)."""
        rows = []
        for i, state in enumerate(states):
            grammar = state.grammar
            if grammar is None or grammar.broken:
                continue
            matcher = grammar.ready_matcher(self.cache, state.output_token_ids)
            if grammar.broken or matcher.is_terminated():
                continue
            if self._bitmask is None:
                self._bitmask = self.cache.backend.allocate_bitmask(self.max_num_reqs)
            matcher.fill_bitmask(self._bitmask, i)
            rows.append(i)
        if rows:
            self.cache.backend.apply_bitmask(logits, self._bitmask, rows)

    @staticmethod
    def accept_token(state, token_id: int) -> None:
        """Advance ``state``'s matcher by the token just sampled for it."""
        grammar = state.grammar
        if grammar is None or grammar.broken or grammar.matcher is None or grammar.matcher.is_terminated():
            return
        if not grammar.matcher.accept_token(token_id):
            grammar.broken = True
            logger.error("%s: sampled token %d is outside its grammar; the rest is unconstrained",
                         state.req_id, token_id)
