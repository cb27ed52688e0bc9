"""A nats-server of this test folder's own, on a free loopback port; the default
model's incremental detokenizer and real token sequences to feed it."""

from __future__ import annotations

import pytest

from services.detokenizer.incremental import IncrementalDetokenizer
from services.launch.nats_server import NatsServer

TEXTS = [
    "héllo wörld, 你好世界！ 😀👍🏽 👨‍👩‍👧 family\n\nnext: Ελληνικά ✓ done. ",
    "日本語のテキストと絵文字🎉🎊が混ざった文章です。終わり。",
    "def f(x):\n    return x ** 2  # 🐍\n\n\nprint(f(3))",
    "🇫🇷🇯🇵 flags, ZWJ 🏳️‍🌈, skin 👋🏿 and math ∑∫√ ≠ ≤.",
]


@pytest.fixture(scope="module")
def nats_server():
    with NatsServer() as server:
        yield server


@pytest.fixture(scope="module")
def detok(smollm_tokenizer):
    return IncrementalDetokenizer(smollm_tokenizer)


@pytest.fixture(scope="module")
def real_sequences(smollm_tokenizer):
    eos = smollm_tokenizer.eos_token_id
    im_start = smollm_tokenizer.backend.token_to_id("<|im_start|>")
    seqs = [smollm_tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    # Special tokens inside the text (skipped by decode), and text after them.
    encode = lambda text: smollm_tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    seqs.append(encode("héllo wörld") + [eos] + encode("你好 😀") + [im_start, im_start] + seqs[3])
    return seqs
