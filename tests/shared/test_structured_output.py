"""The structured-output backend (xgrammar) over the default model's vocabulary: specs,
compiling and its cache, matchers, the bitmask, and the tokenizer service's check."""

from __future__ import annotations

import json

import pytest
import torch

from shared.protocol import SamplingParams
from shared.protocol import StructuredOutputsParams as Spec
from shared.request_validation import InvalidRequest
from shared.structured_output import (
    GrammarCompileCache,
    GrammarError,
    GrammarSpec,
    TokenizerVocabulary,
    grammar_spec,
    make_backend,
)
from shared.structured_output.backend import apply_bitmask_on_cpu
from shared.structured_output.validation import check_structured_outputs

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
    "required": ["name", "age"],
}


@pytest.fixture(scope="module")
def backend(smollm_tokenizer):
    return make_backend(TokenizerVocabulary.from_tokenizer(smollm_tokenizer, smollm_tokenizer.vocab_size))


def allowed(backend, matcher) -> set[int]:
    bitmask = backend.allocate_bitmask(1)
    matcher.fill_bitmask(bitmask, 0)
    logits = torch.zeros(1, backend.vocab_size)
    backend.apply_bitmask(logits, bitmask, [0])
    return set(torch.nonzero(logits[0] == 0).flatten().tolist())


def test_exactly_one_kind_and_canonical_texts():
    assert grammar_spec(Spec(json='{"type":"object"}')) == GrammarSpec("json", '{"type":"object"}')
    assert grammar_spec(Spec(json_object=True)) == GrammarSpec("json_object", "")
    assert grammar_spec(Spec(choice=["a", 'b"'])) == GrammarSpec("choice", '["a", "b\\""]')
    for bad in (Spec(), Spec(regex="a", grammar="root ::= \"a\"")):
        with pytest.raises(ValueError, match="exactly one kind"):
            grammar_spec(bad)


def test_json_schema_matcher_ends_with_eos_only(backend, smollm_tokenizer):
    tok = smollm_tokenizer
    matcher = backend.matcher(backend.compile(GrammarSpec("json", json.dumps(PERSON))), [tok.eos_token_id])
    start = allowed(backend, matcher)
    assert tok.encode("{", add_special_tokens=False)[0] in start and tok.eos_token_id not in start
    for token_id in tok.encode('{"name": "Ann', add_special_tokens=False):
        assert matcher.accept_token(token_id)
    # Inside a string no special token may appear as text.
    assert not allowed(backend, matcher) & set(tok.all_special_ids)
    for token_id in tok.encode('", "age": 42}', add_special_tokens=False):
        assert matcher.accept_token(token_id)
    assert allowed(backend, matcher) == {tok.eos_token_id}
    assert not matcher.accept_token(tok.encode("x", add_special_tokens=False)[0])
    assert matcher.accept_token(tok.eos_token_id) and matcher.is_terminated()


def test_rollback_and_reset_restore_the_allowed_tokens(backend, smollm_tokenizer):
    tok = smollm_tokenizer
    matcher = backend.matcher(backend.compile(GrammarSpec("regex", r"\d{4}-\d{2}-\d{2}")))
    start = allowed(backend, matcher)
    ids = tok.encode("2024-05", add_special_tokens=False)
    for token_id in ids:
        assert matcher.accept_token(token_id)
    after = allowed(backend, matcher)
    assert after != start
    matcher.rollback(len(ids))
    assert allowed(backend, matcher) == start
    for token_id in ids:
        assert matcher.accept_token(token_id)
    assert allowed(backend, matcher) == after
    matcher.reset()
    assert allowed(backend, matcher) == start


def test_choice_with_quotes_and_grammar(backend, smollm_tokenizer):
    tok = smollm_tokenizer
    matcher = backend.matcher(backend.compile(GrammarSpec("choice", json.dumps(['say "hi"', "no"]))),
                              [tok.eos_token_id])
    for token_id in tok.encode('say "hi"', add_special_tokens=False):
        assert matcher.accept_token(token_id)
    assert allowed(backend, matcher) == {tok.eos_token_id}
    arithmetic = backend.compile(GrammarSpec("grammar", 'root ::= num ("+" num)*\nnum ::= [0-9]+'))
    matcher = backend.matcher(arithmetic)
    assert all(matcher.accept_token(t) for t in tok.encode("12+3", add_special_tokens=False))
    assert not matcher.accept_token(tok.encode("*", add_special_tokens=False)[0])


def test_structural_tag_both_forms_compile(backend):
    legacy = {"type": "structural_tag", "triggers": ["<f>"],
              "structures": [{"begin": "<f>", "schema": PERSON, "end": "</f>"}]}
    backend.compile(GrammarSpec("structural_tag", json.dumps(legacy)))
    current = {"type": "structural_tag", "format": {"type": "const_string", "value": "ok"}}
    backend.compile(GrammarSpec("structural_tag", json.dumps(current)))


@pytest.mark.parametrize("spec, words", [
    (GrammarSpec("json", '{"type": "objectx"}'), "objectx"),
    (GrammarSpec("regex", "(abc"), "parenthesis"),
    (GrammarSpec("grammar", "root ::= foo"), "foo"),
])
def test_invalid_specs_say_what_is_wrong(backend, spec, words):
    with pytest.raises(GrammarError, match=words) as info:
        backend.compile(spec)
    assert not str(info.value).startswith("[")  # no xgrammar log prefix


def test_cpu_masking_equals_xgrammars_kernel(backend):
    import xgrammar as xgr

    gen = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, (backend.vocab_size + 31) // 32), dtype=torch.int32, generator=gen)
    logits = torch.randn(5, backend.vocab_size, generator=gen)
    for rows in ([0, 1, 2, 3, 4], [1, 3]):
        ours, reference = logits.clone(), logits.clone()
        apply_bitmask_on_cpu(ours, bitmask, rows)
        xgr.apply_token_bitmask_inplace(reference, bitmask, vocab_size=backend.vocab_size, indices=rows)
        assert torch.equal(ours, reference)
        assert torch.isinf(ours).any() and torch.equal(ours[[i for i in range(5) if i not in rows]],
                                                       logits[[i for i in range(5) if i not in rows]])


def test_compile_cache_compiles_each_spec_once(backend):
    compiled = []

    class Counting:
        def compile(self, spec):
            compiled.append(spec)
            return backend.compile(spec)

    cache = GrammarCompileCache(Counting, max_entries=2)
    a, b, c = (GrammarSpec("regex", r) for r in ("a+", "b+", "c+"))
    first = cache.get(a)
    assert cache.get(GrammarSpec("regex", "a+")) is first
    first.result(timeout=30)
    cache.get(b), cache.get(c)
    assert len(cache) == 2  # the least recently used (a) went
    cache.get(a).result(timeout=30)
    assert compiled.count(a) == 2 and compiled.count(b) == 1
    bad = GrammarSpec("regex", "(")
    assert isinstance(cache.get(bad).exception(timeout=30), GrammarError)
    assert cache.get(bad).exception(timeout=30) is not None and compiled.count(bad) == 2


def test_warm_up_builds_the_backend_once_before_any_compile(backend, caplog):
    built = []

    def make():
        built.append(1)
        return backend

    cache = GrammarCompileCache(make)
    with caplog.at_level("INFO", logger="shared.structured_output.compile_cache"):
        assert cache.warm_up().result(timeout=30) is backend
    assert built == [1] and "structured-output backend ready (xgrammar" in caplog.text
    cache.get(GrammarSpec("regex", "a+")).result(timeout=30)
    assert built == [1]

    def broken():
        raise RuntimeError("no library")

    failing = GrammarCompileCache(broken)
    with caplog.at_level("WARNING", logger="shared.structured_output.compile_cache"):
        assert isinstance(failing.warm_up().exception(timeout=30), RuntimeError)
    assert "not built at start-up: no library" in caplog.text
    # A constrained request meets the failure again, as without the warm-up.
    assert isinstance(failing.get(GrammarSpec("regex", "a+")).exception(timeout=30), RuntimeError)


def test_tokenizer_check(smollm_tokenizer):
    vocab = smollm_tokenizer.vocab_size
    check_structured_outputs(SamplingParams(structured_outputs=Spec(json=json.dumps(PERSON))), smollm_tokenizer, vocab)
    cases = [
        (SamplingParams(structured_outputs=Spec(regex="[a-")), "structured_outputs.regex", "invalid regex"),
        (SamplingParams(structured_outputs=Spec(json='{"type": 5}')), "structured_outputs.json", "invalid JSON schema"),
        (SamplingParams(structured_outputs=Spec(grammar="root ::= x")), "structured_outputs.grammar", "invalid grammar"),
        (SamplingParams(structured_outputs=Spec()), "structured_outputs", "exactly one"),
        (SamplingParams(ignore_eos=True, structured_outputs=Spec(regex="a")), "ignore_eos", "ignore_eos"),
        (SamplingParams(min_tokens=2, structured_outputs=Spec(regex="a")), "min_tokens", "min_tokens"),
    ]
    for params, param, words in cases:
        with pytest.raises(InvalidRequest, match=words) as info:
            check_structured_outputs(params, smollm_tokenizer, vocab)
        assert info.value.error.param == param and info.value.error.status == 400
