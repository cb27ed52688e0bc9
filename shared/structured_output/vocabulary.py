"""The model's vocabulary as a grammar backend needs it, read from our ``Tokenizer``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenizerVocabulary:
    """``tokens[i]`` is token i's string as the tokenizer stores it (byte-level BPE:
    "Ġ" for a space), "" for special tokens (a grammar never produces them as text)
    and for ids the tokenizer lacks; ``vocab_size`` is the model's (the logits'
    width); ``tokenizer_json`` the serialized tokenizer (its decoder tells a backend
    how tokens are encoded); ``stop_token_ids`` end a completed grammar."""

    tokens: tuple[str, ...]
    vocab_size: int
    tokenizer_json: str
    stop_token_ids: tuple[int, ...]

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int) -> TokenizerVocabulary:
        backend = tokenizer.backend
        special = set(tokenizer.all_special_ids)
        tokens = tuple(
            "" if i in special else (backend.id_to_token(i) or "") for i in range(vocab_size)
        )
        eos = tokenizer.eos_token_id
        return cls(tokens, vocab_size, backend.to_str(), (eos,) if eos is not None else ())
