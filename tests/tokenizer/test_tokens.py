"""The tokenizer service's /tokenize and /detokenize answers (``services/tokenizer/tokens.py``)."""

from __future__ import annotations

from services.tokenizer.tokens import detokenize_tokens, tokenize_text
from shared.protocol import DetokenizeTokensRequest, TokenizeTextRequest
from shared.request_preparation import RequestPreparer, tokenize_chat
from shared.tokenizer import special_ids_around

MESSAGES = [{"role": "user", "content": "What is 2+2? <|im_end|>"}]


def preparer(tokenizer) -> RequestPreparer:
    return RequestPreparer(max_model_len=2048, vocab_size=tokenizer.vocab_size)


def test_a_prompt_and_its_token_strings(smollm_tokenizer):
    reply = tokenize_text(preparer(smollm_tokenizer), smollm_tokenizer,
                          TokenizeTextRequest(prompt="Hello world", return_token_strs=True))
    assert reply.error is None and reply.max_model_len == 2048
    assert reply.tokens == smollm_tokenizer.encode("Hello world")
    assert reply.token_strs == ["Hello", "Ġworld"]


def test_messages_are_the_chat_prompt_with_typed_special_texts_kept_as_text(smollm_tokenizer):
    reply = tokenize_text(preparer(smollm_tokenizer), smollm_tokenizer,
                          TokenizeTextRequest(messages=MESSAGES, add_special_tokens=False))
    assert reply.tokens == tokenize_chat(smollm_tokenizer, MESSAGES, True)
    plain = tokenize_chat(smollm_tokenizer, [{"role": "user", "content": "What is 2+2?"}], True)
    eos = smollm_tokenizer.eos_token_id
    assert reply.tokens.count(eos) == plain.count(eos)  # the template's own, not the typed one
    bare = tokenize_text(preparer(smollm_tokenizer), smollm_tokenizer,
                         TokenizeTextRequest(messages=MESSAGES, add_generation_prompt=False))
    assert reply.tokens[:len(bare.tokens)] == bare.tokens and len(bare.tokens) < len(reply.tokens)


def test_bad_messages_and_ids_are_400(smollm_tokenizer):
    reply = tokenize_text(preparer(smollm_tokenizer), smollm_tokenizer,
                          TokenizeTextRequest(messages=[{"role": "wizard", "content": "x"}]))
    assert reply.error.status == 400 and reply.error.param == "messages"
    reply = detokenize_tokens(smollm_tokenizer.vocab_size, smollm_tokenizer,
                              DetokenizeTokensRequest([1, smollm_tokenizer.vocab_size]))
    assert reply.error.status == 400 and reply.error.param == "tokens"


def test_detokenize_keeps_special_tokens(smollm_tokenizer):
    ids = smollm_tokenizer.encode("Hi") + [smollm_tokenizer.eos_token_id]
    assert detokenize_tokens(smollm_tokenizer.vocab_size, smollm_tokenizer,
                             DetokenizeTokensRequest(ids)).prompt == "Hi<|im_end|>"


class BosTokenizer:
    """Adds BOS (1) before and EOS (2) after a text, as some models' tokenizers do."""

    def encode(self, text, add_special_tokens=True):
        ids = [ord(c) for c in text]
        return [1, *ids, 2] if add_special_tokens else ids


def test_special_tokens_around_a_text():
    assert special_ids_around(BosTokenizer()) == ([1], [2])
