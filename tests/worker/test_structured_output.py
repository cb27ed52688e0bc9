"""A worker rank's grammars: the matcher rebuilt by replaying a resumed request's
tokens, rows masked only where constrained, and nothing done after the grammar ended."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from services.worker.structured_output import StructuredOutputRunner
from shared.protocol import SamplingParams
from shared.protocol import StructuredOutputsParams as Spec

DATE = SamplingParams(structured_outputs=Spec(regex=r"\d{4}-\d{2}-\d{2}"))


def state(runner, params, eos, output_token_ids=()):
    return SimpleNamespace(req_id="r", grammar=runner.request_grammar(params, eos),
                           output_token_ids=list(output_token_ids))


def masked_rows(runner, states, vocab_size):
    logits = torch.zeros(len(states), vocab_size)
    runner.mask_logits(logits, states)
    return [set(torch.nonzero(row == 0).flatten().tolist()) for row in logits]


def test_replayed_tokens_give_the_same_mask_as_accepted_ones(smollm_path, smollm_tokenizer):
    tok = smollm_tokenizer
    vocab = tok.vocab_size
    runner = StructuredOutputRunner(smollm_path, vocab, max_num_reqs=4)
    assert runner.request_grammar(SamplingParams(), tok.eos_token_id) is None
    ids = tok.encode("2024-1", add_special_tokens=False)
    live = state(runner, DATE, tok.eos_token_id)
    for token_id in ids:
        masked_rows(runner, [live], vocab)
        live.output_token_ids.append(token_id)
        runner.accept_token(live, token_id)
    # A request resumed on a restarted worker arrives with its output tokens.
    resumed = state(runner, DATE, tok.eos_token_id, ids)
    free = SimpleNamespace(req_id="f", grammar=None, output_token_ids=[])
    live_mask, free_mask, resumed_mask = masked_rows(runner, [live, free, resumed], vocab)
    assert live_mask == resumed_mask and 0 < len(live_mask) < 20
    assert free_mask == set(range(vocab))


def test_a_finished_grammar_leaves_later_rows_alone(smollm_path, smollm_tokenizer):
    tok = smollm_tokenizer
    runner = StructuredOutputRunner(smollm_path, tok.vocab_size, max_num_reqs=2)
    done = state(runner, SamplingParams(structured_outputs=Spec(choice=["yes"])), tok.eos_token_id)
    for token_id in tok.encode("yes", add_special_tokens=False) + [tok.eos_token_id]:
        assert masked_rows(runner, [done], tok.vocab_size)[0] != set(range(tok.vocab_size))
        done.output_token_ids.append(token_id)
        runner.accept_token(done, token_id)
    assert done.grammar.matcher.is_terminated()
    # The token computed in vain after EOS (async scheduling) is neither masked nor refused.
    assert masked_rows(runner, [done], tok.vocab_size)[0] == set(range(tok.vocab_size))
    runner.accept_token(done, 5)
    assert not done.grammar.broken
