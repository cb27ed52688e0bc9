"""The tokenizer service's answers to vLLM's ``/tokenize`` and ``/detokenize``.

No request is scheduled: a prompt (or chat messages, rendered with the model's template
as for generation) becomes its ids, and ids become text. The gateway asks on
``llm.tokenizer.tokenize`` / ``llm.tokenizer.detokenize`` (request/reply, the
tokenizer queue group). vLLM's meaning: ``add_special_tokens`` adds what the model's
tokenizer adds around a text (BOS, ...), default true for a prompt and false for
messages (the template has them); ``token_strs`` are the vocabulary's token strings;
``/detokenize`` keeps special tokens' text. Token ids outside the vocabulary are a 400.
"""

from __future__ import annotations

from shared.protocol import (
    DetokenizeTokensReply,
    DetokenizeTokensRequest,
    TokenizeTextReply,
    TokenizeTextRequest,
)
from shared.request_preparation import RequestPreparer, tokenize_chat
from shared.request_validation import InvalidRequest


def tokenize_text(preparer: RequestPreparer, tokenizer, request: TokenizeTextRequest) -> TokenizeTextReply:
    """CPU work (the service runs it in a thread); never raises for bad input."""
    try:
        if (request.prompt is None) == (request.messages is None):
            raise InvalidRequest("exactly one of prompt and messages must be given", param="prompt")
        if request.messages is not None:
            ids = tokenize_chat(tokenizer, request.messages, request.add_generation_prompt,
                                preparer.special_tokens_in_content,
                                continue_final_message=request.continue_final_message,
                                add_special_tokens=request.add_special_tokens)
        else:
            ids = tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)
    except InvalidRequest as e:
        return TokenizeTextReply(error=e.error)
    token_strs = tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
    return TokenizeTextReply(tokens=ids, token_strs=token_strs, max_model_len=preparer.max_model_len)


def detokenize_tokens(vocab_size: int, tokenizer, request: DetokenizeTokensRequest) -> DetokenizeTokensReply:
    bad = [t for t in request.tokens if not 0 <= t < vocab_size]
    if bad:
        error = InvalidRequest(f"tokens has {bad[0]}, outside the vocabulary [0, {vocab_size})", param="tokens")
        return DetokenizeTokensReply(error=error.error)
    return DetokenizeTokensReply(prompt=tokenizer.decode(request.tokens, skip_special_tokens=False))
