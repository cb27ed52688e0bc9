"""The model's tokenizer: ``load_tokenizer(path)`` for a GGUF file or a Hugging Face folder.

For a GGUF file the ``tokenizers.Tokenizer`` is rebuilt from the metadata llama.cpp
stores (byte-level BPE vocabulary, merges, token types, special ids), with the
pre-tokenizer that the file's ``tokenizer.ggml.pre`` names; a Gemma file's sentencepiece
vocabulary becomes the BPE transformers builds from it (``_gemma_sentencepiece``). For a folder it is read
from tokenizer.json and tokenizer_config.json. Chat templates are rendered with
Jinja2 the way transformers does (sandboxed, trim_blocks, lstrip_blocks).
"""

from __future__ import annotations

import functools
import logging
import os
import re
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from shared.chat_template import compile_template
from shared.model_config import gguf_value, open_gguf, read_json, resolve_model_path
from shared.tool_template import template_handles_tools, tools_in_messages

logger = logging.getLogger(__name__)

# llama_token_type values in tokenizer.ggml.token_type.
_CONTROL, _USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2_pre() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _split_pre(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


# tokenizer.ggml.pre -> (pre-tokenizer, BPE ignore_merges), as llama.cpp's llama-vocab.cpp
# splits each pre-type. "smollm" is the original SmolLM2 tokenizer.json: every digit
# alone, then GPT-2's byte-level regex.
_GGUF_PRE_TOKENIZERS = {
    "default": (_gpt2_pre, False),
    "gpt2": (_gpt2_pre, False),
    "smollm": (
        lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_pre()]),
        False,
    ),
    "llama-bpe": (lambda: _split_pre(_LLAMA3_SPLIT), True),
    "llama3": (lambda: _split_pre(_LLAMA3_SPLIT), True),
    "qwen2": (lambda: _split_pre(_QWEN2_SPLIT), False),
}


# Supplementary private-use code points: never in a real prompt's text.
_SENTINEL_BASE = 0xF0000
# continue_final_message: appended to the final message's content, so that the rendered
# prompt can be cut right where that content ends (transformers' way).
_CONTINUE_MARK = "CONTINUE_FINAL_MESSAGE_HERE "


class Tokenizer:
    """Our tokenizer: a ``tokenizers.Tokenizer`` (``.backend``) plus special ids and chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None,
        eos_token: str | None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token, self.eos_token = bos_token, eos_token
        self.unk_token, self.pad_token = unk_token, pad_token
        self.chat_template = chat_template
        self._id = {t: backend.token_to_id(t) for t in (bos_token, eos_token, unk_token, pad_token) if t is not None}
        probe = backend.encode("a", add_special_tokens=True).ids
        # Whether the post-processor adds BOS: llama.cpp's / HF's add_bos_token.
        self.add_bos_token = bool(probe) and self.bos_token_id is not None and probe[0] == self.bos_token_id

    # ---------------------------------------------------------------- ids and text

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; BOS (and EOS) only where the model's tokenizer adds them."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.backend.id_to_token(i) for i in ids]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        """Text of a token list (as transformers: the backend's decoder applied to them)."""
        decoder = self.backend.decoder
        return decoder.decode(list(tokens)) if decoder is not None else "".join(tokens)

    @property
    def bos_token_id(self) -> int | None:
        return self._id.get(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self._id.get(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self._id.get(self.pad_token)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included (may be < the model's)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def all_special_ids(self) -> list[int]:
        ids = {i for i, tok in self.backend.get_added_tokens_decoder().items() if tok.special}
        ids.update(i for i in self._id.values() if i is not None)
        return sorted(ids)

    @functools.cached_property
    def special_token_texts(self) -> tuple[str, ...]:
        """The texts that encode to special (control) tokens, longest first."""
        texts = {tok.content for tok in self.backend.get_added_tokens_decoder().values() if tok.special}
        return tuple(sorted(texts, key=len, reverse=True))

    @functools.cached_property
    def _plain_backend(self) -> tokenizers.Tokenizer:
        """A copy of the backend that encodes special-token texts as ordinary text."""
        plain = tokenizers.Tokenizer.from_str(self.backend.to_str())
        plain.encode_special_tokens = True
        return plain

    def encode_plain(self, text: str) -> list[int]:
        """Ids of ``text`` with no special token: ``<|im_end|>`` typed by a user is text."""
        return self._plain_backend.encode(text, add_special_tokens=False).ids

    # ---------------------------------------------------------------- chat

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        special_in_content: bool = False,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """The chat prompt's ids. Special-token texts inside the messages and tools (their
        contents, tool calls, tool descriptions: every string the client sent) are encoded
        as plain text (a user cannot forge the template's control tokens) unless
        ``special_in_content``; the template's own special tokens stay control tokens.
        ``add_special_tokens``: what the tokenizer adds around a text (BOS, ...) is added
        around the rendered prompt too (vLLM's field; off by default, the template has them)."""
        render = functools.partial(self.apply_chat_template, add_generation_prompt=add_generation_prompt,
                                   continue_final_message=continue_final_message, **(template_kwargs or {}))
        ids = self._encode_rendered_chat(render, messages, tools, special_in_content)
        if add_special_tokens:
            before, after = special_ids_around(self)
            ids = before + ids + after
        return ids

    def _encode_rendered_chat(self, render, messages, tools, special_in_content: bool) -> list[int]:
        """The ids of ``render(messages, tools=tools)``, special texts in the client's strings as text."""
        texts = _strings([messages, tools])
        found = [t for t in self.special_token_texts if any(t in c for c in texts)]
        if special_in_content or not found:
            return self.encode(render(messages, tools=tools), add_special_tokens=False)
        # Each special text in a client's string becomes a private-use sentinel character;
        # the rendered prompt is encoded piece by piece around the sentinels.
        sentinel = {text: chr(_SENTINEL_BASE + i) for i, text in enumerate(found)}
        pattern = re.compile("|".join(re.escape(t) for t in found))

        def guard(text: str) -> str:
            return pattern.sub(lambda mt: sentinel[mt.group(0)], text)

        rendered = render(_map_strings(messages, guard), tools=_map_strings(tools, guard))
        text_of = {v: k for k, v in sentinel.items()}
        ids: list[int] = []
        for piece in re.split(f"([{''.join(text_of)}])", rendered):
            if piece in text_of:
                ids += self.encode_plain(text_of[piece])
            elif piece:
                ids += self.encode(piece, add_special_tokens=False)
        return ids

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        **kwargs: Any,
    ) -> str:
        """The prompt text for ``messages`` (and ``tools``), rendered as transformers
        renders it; ``kwargs`` reach the template as variables. A template that knows
        nothing of tools gets them through the built-in fallback (``shared.tool_template``).
        ``continue_final_message``: the text ends where the final message's content does
        (no end-of-turn after it), so the model goes on with that message."""
        if not continue_final_message:
            return self._render_chat(messages, add_generation_prompt, tools, **kwargs)
        if add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        final = messages[-1].get("content") or ""
        marked = [*messages[:-1], {**messages[-1], "content": final + _CONTINUE_MARK}]
        rendered = self._render_chat(marked, False, tools, **kwargs)
        at = rendered.rfind(_CONTINUE_MARK.strip())
        if at < 0 or final.strip() not in rendered[:at]:
            raise ValueError("continue_final_message: the chat template does not render the final message's "
                             "content as it is, so there is no place to continue it from")
        # A template that trims the content trims the mark's trailing space too: then the
        # content's own trailing spaces are gone as well.
        return rendered[:at] if rendered.startswith(_CONTINUE_MARK, at) else rendered[:at].rstrip()

    def _render_chat(self, messages, add_generation_prompt: bool, tools, **kwargs: Any) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template")
        if not template_handles_tools(self.chat_template):
            messages, tools = tools_in_messages(messages, tools), None
        context = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "unk_token": self.unk_token or "",
            "pad_token": self.pad_token or "",
        }
        context.update(kwargs)
        if tools is not None:
            context["tools"] = tools
        return compile_template(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **context
        )


def special_ids_around(tokenizer) -> tuple[list[int], list[int]]:
    """The ids ``tokenizer`` adds before and after a text when adding special tokens."""
    marker = tokenizer.encode("a", add_special_tokens=False)
    ids = tokenizer.encode("a", add_special_tokens=True)
    for start in range(len(ids) - len(marker) + 1):
        if ids[start:start + len(marker)] == marker:
            return ids[:start], ids[start + len(marker):]
    return [], []


def _strings(value) -> list[str]:
    """Every string inside a JSON value (not the keys)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def _map_strings(value, fn):
    """A JSON value with ``fn`` applied to every string inside it (not the keys)."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {k: _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_strings(v, fn) for v in value]
    return value


# --------------------------------------------------------------------------- loading


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer of a ``.gguf`` file or a Hugging Face folder."""
    kind, p = resolve_model_path(path)
    return _tokenizer_from_gguf(p) if kind == "gguf" else _tokenizer_from_hf(p)


@functools.lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the byte-level BPE alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


# general.architecture values whose sentencepiece ("llama") vocabulary is Gemma's.
_GEMMA_SENTENCEPIECE = ("gemma", "gemma2", "gemma3")


def _tokenizer_from_gguf(path: Path) -> Tokenizer:
    reader = open_gguf(path)
    model = gguf_value(reader, "tokenizer.ggml.model")
    architecture = gguf_value(reader, "general.architecture")
    tokens: list[str] = gguf_value(reader, "tokenizer.ggml.tokens")
    types: list[int] = gguf_value(reader, "tokenizer.ggml.token_type", None) or [1] * len(tokens)
    if model == "llama" and architecture in _GEMMA_SENTENCEPIECE:
        backend, vocab = _gemma_sentencepiece(tokens)
    elif model == "gpt2":
        backend, vocab = _byte_level_bpe(path, reader, tokens)
    else:
        raise ValueError(
            f"{path}: GGUF tokenizer model {model!r} of a {architecture!r} model is not supported (byte-level "
            f"BPE, 'gpt2', or Gemma's sentencepiece vocabulary); use the model's Hugging Face folder instead"
        )

    # Control and user-defined tokens are matched whole in the text, as llama.cpp does; only
    # control tokens are special (skipped by decode(skip_special_tokens=True)).
    def added(token_type: int) -> list[AddedToken]:
        return [
            AddedToken(t, normalized=False, special=token_type == _CONTROL)
            for t, ty in zip(tokens, types)
            if ty == token_type and t in vocab
        ]

    backend.add_special_tokens(added(_CONTROL))
    backend.add_tokens(added(_USER_DEFINED))
    if backend.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise ValueError(f"{path}: rebuilt vocabulary has {backend.get_vocab_size()} tokens, file has {len(tokens)}")

    def token_of(key: str) -> str | None:
        i = gguf_value(reader, f"tokenizer.ggml.{key}", None)
        return None if i is None else tokens[int(i)]

    bos, eos = token_of("bos_token_id"), token_of("eos_token_id")
    add_bos = bool(gguf_value(reader, "tokenizer.ggml.add_bos_token", False))
    add_eos = bool(gguf_value(reader, "tokenizer.ggml.add_eos_token", False))
    backend.post_processor = _template_processor(backend, bos if add_bos else None, eos if add_eos else None)
    return Tokenizer(
        backend,
        bos_token=bos,
        eos_token=eos,
        unk_token=token_of("unknown_token_id"),
        pad_token=token_of("padding_token_id"),
        chat_template=gguf_value(reader, "tokenizer.chat_template", None),
    )


def _byte_level_bpe(path: Path, reader, tokens: list[str]) -> tuple[tokenizers.Tokenizer, dict[str, int]]:
    """A byte-level BPE vocabulary (``tokenizer.ggml.model`` "gpt2") with its merges and the
    pre-tokenizer ``tokenizer.ggml.pre`` names."""
    pre = gguf_value(reader, "tokenizer.ggml.pre", "default")
    if pre not in _GGUF_PRE_TOKENIZERS:
        raise ValueError(f"{path}: GGUF pre-tokenizer {pre!r} is not supported ({sorted(_GGUF_PRE_TOKENIZERS)})")
    make_pre, ignore_merges = _GGUF_PRE_TOKENIZERS[pre]
    merges = [tuple(m.split(" ", 1)) for m in gguf_value(reader, "tokenizer.ggml.merges")]
    alphabet = byte_alphabet()
    alphabet_chars = set(alphabet.values())

    def spelled(token: str) -> str:
        # Tokens outside the byte alphabet (a few files store raw text) are respelled, as transformers does.
        if set(token) <= alphabet_chars:
            return token
        return "".join(alphabet[b] for b in token.encode("utf-8"))

    vocab = {spelled(t): i for i, t in enumerate(tokens)}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    backend.pre_tokenizer = make_pre()
    backend.decoder = decoders.ByteLevel()
    return backend, vocab


def _gemma_sentencepiece(tokens: list[str]) -> tuple[tokenizers.Tokenizer, dict[str, int]]:
    """Gemma's sentencepiece vocabulary as the BPE transformers builds from the same file
    (its ``GemmaTokenizer``: spaces normalised to "▁", byte fallback, no prefix space).

    The file has no merges: they are recovered from the vocabulary, every split of a token
    into two tokens, ranked by the token's position in the file (Gemma's scores do not
    follow its merge order; its order does). A token of two or more spaces is stored as
    real spaces and is looked up as as many "▁"."""
    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    rank = {t: -i for i, t in enumerate(tokens)}
    merges = []
    for token, token_rank in rank.items():
        splits = [(token[:k], token[k:], token_rank) for k in range(1, len(token))
                  if token[:k] in vocab and token[k:] in vocab]
        splits.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges += splits
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for a, b, _ in merges], fuse_unk=True,
                                              unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return backend, vocab


def _template_processor(backend: tokenizers.Tokenizer, bos: str | None, eos: str | None):
    single = " ".join(([f"{bos}:0"] if bos else []) + ["$A:0"] + ([f"{eos}:0"] if eos else []))
    pair = single + " " + " ".join(([f"{bos}:1"] if bos else []) + ["$B:1"] + ([f"{eos}:1"] if eos else []))
    specials = [(t, backend.token_to_id(t)) for t in (bos, eos) if t]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def _token_str(value: Any) -> str | None:
    # tokenizer_config.json spells a special token as a string or as an AddedToken dict.
    if isinstance(value, dict):
        return value.get("content")
    return value


def _tokenizer_from_hf(folder: Path) -> Tokenizer:
    if not (folder / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{folder} has no tokenizer.json (only fast tokenizers are supported)")
    backend = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    config = read_json(folder / "tokenizer_config.json") or {}
    bos, eos = _token_str(config.get("bos_token")), _token_str(config.get("eos_token"))
    # tokenizer.json's post-processor decides BOS/EOS (as in transformers 5); only without one
    # do tokenizer_config's add_bos_token/add_eos_token flags apply (as LlamaTokenizerFast did).
    if backend.post_processor is None:
        backend.post_processor = _template_processor(
            backend,
            bos if config.get("add_bos_token") and bos else None,
            eos if config.get("add_eos_token") and eos else None,
        )
    template = config.get("chat_template")
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    elif template is None and (folder / "chat_template.json").is_file():
        template = read_json(folder / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # named templates: use the default one
        template = {t["name"]: t["template"] for t in template}.get("default")
    return Tokenizer(
        backend,
        bos_token=bos,
        eos_token=eos,
        unk_token=_token_str(config.get("unk_token")),
        pad_token=_token_str(config.get("pad_token")),
        chat_template=template,
    )
