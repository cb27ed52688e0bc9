"""Our tokenizer against transformers' tokenizer of the same files (GGUF and HF folders)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from tokenizers import pre_tokenizers

from shared.tokenizer import load_tokenizer
from tests.hf_reference import make_tiny_random_llama

CORPUS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    " leading space and trailing space ",
    "1234567",
    "a 12 b 3.14159 -42 1,000,000 and 2024-01-31 at 23:59:59",
    "1.2e-10 0x1F 007 v1.2.3",
    'def f(x):\n    return x ** 2  # square\n\n\nprint(f(3), "done")\n',
    "for (int i = 0; i < n; ++i) { a[i] += b[i]; }\n",
    "\t\ttabs\tand   spaces   between",
    "\n\n\nnewlines\n",
    "  \n  \n",
    "   ",
    "\r\n\r\nwindows line endings\r\n",
    "😀🎉👍🏽 emoji, ZWJ 👨‍👩‍👧",
    "中文测试，日本語のテキスト、한국어 텍스트",
    "naïve café résumé Ωμέγα Привет мир",
    "don't I'll we've THEY'RE it's",
    "\u200b zero width\u00a0nbsp",
    "<|im_start|>system\nYou are helpful<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n",
    "<|im_start|>",
    "a<|im_end|>b",
    "<|endoftext|><file_sep><repo_name>x",
]
# Non-ASCII numerals: transformers' GGUF tokenizer ignores llama.cpp's "smollm" pre-type
# (GPT-2 regex only, " ½" stays one piece); SmolLM2's tokenizer.json and llama.cpp isolate
# every \p{N} character first, as we do.
UNICODE_NUMERALS = "x²+y³ ½ ¼ ٣٤ ５６７ Ⅻ"

MESSAGES = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "What is 2+2? Answer with one number."},
]

# Llama-3 style: tokenizer.json's post-processor adds BOS (<|endoftext|>, 0 in the tiny vocabulary).
BOS_POST_PROCESSOR = {
    "type": "TemplateProcessing",
    "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
    "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
    "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]}},
}


@pytest.fixture(scope="module")
def hf_gguf_tokenizer(smollm_path):
    from transformers import AutoTokenizer

    path = Path(smollm_path)
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


# --------------------------------------------------------------------------- GGUF


@pytest.mark.parametrize("text", CORPUS)
def test_gguf_encode_matches_transformers_and_round_trips(smollm_tokenizer, hf_gguf_tokenizer, text):
    ids = smollm_tokenizer.encode(text)
    assert ids == hf_gguf_tokenizer(text)["input_ids"]
    assert smollm_tokenizer.encode(text, add_special_tokens=False) == ids  # SmolLM2 adds no BOS
    assert smollm_tokenizer.decode(ids, skip_special_tokens=False) == text
    assert smollm_tokenizer.decode(ids) == hf_gguf_tokenizer.decode(ids, skip_special_tokens=True)


def test_gguf_digits_are_split_one_by_one(smollm_tokenizer):
    ids = smollm_tokenizer.encode("1234567")
    assert smollm_tokenizer.convert_ids_to_tokens(ids) == list("1234567")
    ids = smollm_tokenizer.encode("x²+y³ ½")
    assert smollm_tokenizer.decode(ids) == "x²+y³ ½"


def test_gguf_unicode_numerals_follow_smollm2_pre_tokenizer(smollm_tokenizer, hf_gguf_tokenizer):
    # Same vocabulary, merges and added tokens as transformers: with SmolLM2's tokenizer.json
    # pre-tokenizer put into transformers' backend, the ids agree.
    backend = hf_gguf_tokenizer.backend_tokenizer
    saved = backend.pre_tokenizer
    try:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        )
        want = backend.encode(UNICODE_NUMERALS).ids
    finally:
        backend.pre_tokenizer = saved
    assert smollm_tokenizer.encode(UNICODE_NUMERALS) == want
    assert smollm_tokenizer.decode(want) == UNICODE_NUMERALS


def test_gguf_special_tokens(smollm_tokenizer):
    tok = smollm_tokenizer
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("<|im_end|>") == [2]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert tok.add_bos_token is False
    assert tok.vocab_size == 49152
    assert tok.all_special_ids == list(range(17))  # every control token of the file
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert tok.decode(ids) == "user\nhi"
    assert tok.convert_ids_to_tokens(ids)[0] == "<|im_start|>"


def test_gguf_tokens_to_string_handles_split_utf8(smollm_tokenizer):
    text = "héllo 😀 wörld 中文"
    tokens = smollm_tokenizer.convert_ids_to_tokens(smollm_tokenizer.encode(text))
    assert smollm_tokenizer.convert_tokens_to_string(tokens) == text
    # An incremental detokenizer sees prefixes that may end inside a UTF-8 character.
    prefix = smollm_tokenizer.convert_tokens_to_string(tokens[:-1])
    assert text.startswith(prefix.rstrip("\ufffd"))


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_gguf_chat_template_matches_transformers(smollm_tokenizer, hf_gguf_tokenizer, add_generation_prompt):
    ours = smollm_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt)
    want = hf_gguf_tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == want
    assert ours.startswith("<|im_start|>system\nYou are a concise assistant.<|im_end|>\n")
    assert ours.endswith("<|im_start|>assistant\n") == add_generation_prompt


@pytest.mark.parametrize("final", ["The answer is", "The answer is ", "", "Four <|im_end|> or"])
def test_continue_final_message_matches_transformers(smollm_tokenizer, hf_gguf_tokenizer, final):
    """vLLM's continue_final_message: the prompt ends where the final message's content does
    (SmolLM2's template keeps the content's spaces as they are), as transformers renders it."""
    messages = [*MESSAGES, {"role": "assistant", "content": final}]
    ours = smollm_tokenizer.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert ours == hf_gguf_tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert ours.endswith("<|im_start|>assistant\n" + final)
    ids = smollm_tokenizer.encode_chat(messages, add_generation_prompt=False, continue_final_message=True)
    # The typed <|im_end|> stays text: only the template's own end-of-turn tokens are control tokens.
    assert ids.count(smollm_tokenizer.eos_token_id) == 2
    assert smollm_tokenizer.decode(ids, skip_special_tokens=False) == ours
    with pytest.raises(ValueError, match="cannot both be true"):
        smollm_tokenizer.apply_chat_template(messages, add_generation_prompt=True, continue_final_message=True)


def test_continue_final_message_under_a_trimming_template(smollm_path):
    """A template that trims the content trims its trailing spaces too (transformers' rule);
    one that does not render the content has nowhere to continue from."""
    tok = load_tokenizer(smollm_path)
    trimming = tok.chat_template.replace("message['content']", "message['content'] | trim")
    assert trimming != tok.chat_template
    tok.chat_template = trimming
    text = tok.apply_chat_template([*MESSAGES, {"role": "assistant", "content": "  Four, and "}],
                                   add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nFour, and")
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}{% endfor %}"
    with pytest.raises(ValueError, match="no place to continue"):
        tok.apply_chat_template([*MESSAGES, {"role": "assistant", "content": "Four"}],
                                add_generation_prompt=False, continue_final_message=True)


def test_documents_and_added_special_tokens_reach_a_chat_prompt(tiny_folder, tmp_path):
    """vLLM's documents are a template variable; add_special_tokens adds what the tokenizer
    adds around a text (here BOS, from a Llama-3 style post-processor) around the prompt."""
    folder = tmp_path / "docs"
    tokenizer_json, config = _copy_tiny_tokenizer(tiny_folder, folder)
    tokenizer_json["post_processor"] = BOS_POST_PROCESSOR
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    config["chat_template"] = ("{% for d in documents %}[{{ d['title'] }}: {{ d['text'] }}]{% endfor %}"
                               "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    config.pop("add_bos_token", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(folder)
    docs = [{"title": "a", "text": "one"}, {"title": "b", "text": "two"}]
    user = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(user, documents=docs) == "[a: one][b: two]hi"
    plain = tok.encode_chat(user, template_kwargs={"documents": docs})
    assert plain == tok.encode("[a: one][b: two]hi", add_special_tokens=False)
    assert tok.encode_chat(user, template_kwargs={"documents": docs}, add_special_tokens=True) == [0] + plain


def test_gguf_chat_template_default_system_prompt(smollm_tokenizer, hf_gguf_tokenizer):
    messages = MESSAGES[1:]
    ours = smollm_tokenizer.apply_chat_template(messages)
    assert ours == hf_gguf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "You are a helpful AI assistant named SmolLM" in ours


def test_load_tokenizer_from_folder_holding_the_gguf(smollm_path, smollm_tokenizer):
    tok = load_tokenizer(os.path.dirname(smollm_path))
    assert tok.encode(CORPUS[6]) == smollm_tokenizer.encode(CORPUS[6])


# --------------------------------------------------------------------------- HF folders


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return make_tiny_random_llama(tmp_path_factory.mktemp("tiny-tok"), seed=0)


def test_hf_folder_tokenizer_matches_transformers(tiny_folder):
    from transformers import AutoTokenizer

    ours, hf = load_tokenizer(tiny_folder), AutoTokenizer.from_pretrained(str(tiny_folder))
    for text in CORPUS + [UNICODE_NUMERALS]:
        ids = ours.encode(text)
        assert ids == hf(text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=False) == text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert (ours.bos_token_id, ours.eos_token_id, ours.vocab_size) == (0, 2, 320)
    assert ours.encode("<|im_start|>") == [1]
    assert ours.apply_chat_template(MESSAGES) == hf.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )


def _copy_tiny_tokenizer(tiny_folder: Path, folder: Path) -> tuple[dict, dict]:
    folder.mkdir()
    (folder / "config.json").write_text((tiny_folder / "config.json").read_text())
    return (json.loads((tiny_folder / "tokenizer.json").read_text()),
            json.loads((tiny_folder / "tokenizer_config.json").read_text()))


def test_hf_folder_bos_from_post_processor_and_template_file(tiny_folder, tmp_path):
    from transformers import AutoTokenizer

    folder = tmp_path / "bos"
    tokenizer_json, config = _copy_tiny_tokenizer(tiny_folder, folder)
    tokenizer_json["post_processor"] = BOS_POST_PROCESSOR
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    template = config.pop("chat_template") + "{{ bos_token }}"
    config.pop("add_bos_token")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").write_text(template)
    ours, hf = load_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder))
    assert ours.add_bos_token
    plain = ours.encode("hello there", add_special_tokens=False)
    assert ours.encode("hello there") == hf("hello there")["input_ids"] == [0] + plain
    assert ours.apply_chat_template(MESSAGES) == hf.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
    assert ours.apply_chat_template(MESSAGES).endswith("<|endoftext|>")


def test_hf_folder_add_bos_flag_applies_without_post_processor(tiny_folder, tmp_path):
    folder = tmp_path / "flag"
    tokenizer_json, config = _copy_tiny_tokenizer(tiny_folder, folder)
    assert tokenizer_json["post_processor"] is None
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    tok = load_tokenizer(folder)
    assert tok.add_bos_token and tok.encode("hi") == [0] + tok.encode("hi", add_special_tokens=False)


def test_smollm_tokenizer_saved_as_hf_folder_round_trips(smollm_tokenizer, tmp_path):
    smollm_tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": smollm_tokenizer.chat_template,
    }))
    tok = load_tokenizer(tmp_path)
    for text in CORPUS + [UNICODE_NUMERALS]:
        assert tok.encode(text) == smollm_tokenizer.encode(text), text
    assert tok.apply_chat_template(MESSAGES) == smollm_tokenizer.apply_chat_template(MESSAGES)


def test_chat_template_helpers_and_errors(tiny_folder):
    import jinja2

    tok = load_tokenizer(tiny_folder)
    tok.chat_template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
        "{{ messages | tojson }}"
    )
    assert tok.apply_chat_template([{"role": "user", "content": "é<b>"}]) == '[{"role": "user", "content": "é<b>"}]'
    with pytest.raises(jinja2.exceptions.TemplateError, match="first must be user"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])
    tok.chat_template = "{{ ''.__class__.__mro__ }}"
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template([])
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template(MESSAGES)
