"""A whole stack: vLLM's request fields about the output text, with real services.

Two tokenizer and two detokenizer replicas (each output may go to either detokenizer,
so a request's text settings must reach both). Each test first runs the request
without the field (greedy), then with it, and checks the difference: ``stop_reason``
(the stop string or stop token id; null for EOS and length), streamed and not, chat
and completions; ``include_stop_str_in_output``; ``skip_special_tokens`` with the EOS
text kept.
"""

from __future__ import annotations

import json

import httpx
import pytest

from services.launch.stack import StackConfig
from tests.e2e.stacks import replicated_config, running_stack

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is Paris. The capital of Germany is"
CHAT = [{"role": "user", "content": "Say hello in one short sentence."}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    config: StackConfig = replicated_config(tmp_path_factory.mktemp("fields-logs"), ["--num-gpu-blocks", "512"])
    with running_stack(config) as stack:
        yield stack


def post(stack, path: str, body: dict) -> httpx.Response:
    return httpx.post(stack.base_url + path, json={"model": MODEL, **body}, timeout=300)


def complete(stack, **fields) -> dict:
    r = post(stack, "/v1/completions", {"prompt": PROMPT, "temperature": 0, "max_tokens": 24, **fields})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def chat(stack, **fields) -> dict:
    r = post(stack, "/v1/chat/completions", {"messages": CHAT, "temperature": 0, "max_tokens": 64, **fields})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def streamed(stack, path: str, body: dict) -> tuple[str, list[dict]]:
    """The streamed text and every choice object of the stream."""
    text, choices = [], []
    with httpx.stream("POST", stack.base_url + path, json={"model": MODEL, "stream": True, **body},
                      timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[len("data: "):])
            assert "error" not in event, event
            for choice in event["choices"]:
                choices.append(choice)
                text.append(choice["delta"].get("content", "") if "delta" in choice else choice["text"])
    return "".join(text), choices


def a_stop_word(text: str) -> str:
    """A word from the middle of ``text`` whose first occurrence is its only one."""
    words = [w for w in text.split() if len(w) >= 3 and text.count(w) == 1]
    assert words, text
    return words[len(words) // 2]


def test_stop_reason_is_the_stop_string_and_include_keeps_it(stack):
    base = complete(stack)
    assert base["finish_reason"] == "length" and base["stop_reason"] is None
    word = a_stop_word(base["text"])
    cut = base["text"].index(word)
    stopped = complete(stack, stop=["zzzz", word])
    assert stopped["text"] == base["text"][:cut]
    assert stopped["finish_reason"] == "stop" and stopped["stop_reason"] == word
    kept = complete(stack, stop=[word], include_stop_str_in_output=True)
    assert kept["text"] == base["text"][:cut + len(word)] and kept["stop_reason"] == word
    body = {"prompt": PROMPT, "temperature": 0, "max_tokens": 24, "stop": [word]}
    for include in (False, True):
        text, choices = streamed(stack, "/v1/completions", {**body, "include_stop_str_in_output": include})
        assert text == base["text"][:cut + (len(word) if include else 0)]
        assert choices[-1]["finish_reason"] == "stop" and choices[-1]["stop_reason"] == word
        assert all(c["stop_reason"] is None for c in choices[:-1])


def test_stop_reason_is_the_stop_token_id(stack, smollm_tokenizer):
    base = complete(stack)
    ids = smollm_tokenizer.encode(base["text"], add_special_tokens=False)
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    stopped = complete(stack, stop_token_ids=[ids[k]])
    assert stopped["finish_reason"] == "stop" and stopped["stop_reason"] == ids[k]
    # vLLM: the stop token's text is not in the output unless include_stop_str_in_output.
    assert stopped["text"] == smollm_tokenizer.decode(ids[:k])
    kept = complete(stack, stop_token_ids=[ids[k]], include_stop_str_in_output=True)
    assert kept["text"] == smollm_tokenizer.decode(ids[:k + 1]) and kept["stop_reason"] == ids[k]


def test_chat_stop_reason_streamed_and_not(stack):
    base = chat(stack)
    assert base["finish_reason"] == "stop" and base["stop_reason"] is None  # EOS
    word = a_stop_word(base["message"]["content"])
    stopped = chat(stack, stop=[word])
    assert stopped["message"]["content"] == base["message"]["content"][:base["message"]["content"].index(word)]
    assert stopped["stop_reason"] == word
    body = {"messages": CHAT, "temperature": 0, "max_tokens": 64, "stop": [word]}
    text, choices = streamed(stack, "/v1/chat/completions", body)
    assert text == stopped["message"]["content"]
    assert choices[-1]["finish_reason"] == "stop" and choices[-1]["stop_reason"] == word
    text, choices = streamed(stack, "/v1/chat/completions", {**body, "stop": None})
    assert text == base["message"]["content"]
    assert choices[-1]["finish_reason"] == "stop" and choices[-1]["stop_reason"] is None


def test_special_tokens_kept_show_the_eos_text(stack):
    base = chat(stack)["message"]["content"]
    assert base and "<|im_end|>" not in base
    # The EOS ends the request: its text is kept only with include_stop_str_in_output (vLLM).
    assert chat(stack, skip_special_tokens=False)["message"]["content"] == base
    kept = chat(stack, skip_special_tokens=False, include_stop_str_in_output=True,
                spaces_between_special_tokens=False)
    assert kept["message"]["content"] == base + "<|im_end|>" and kept["stop_reason"] is None
    assert chat(stack, include_stop_str_in_output=True)["message"]["content"] == base  # skipped


@pytest.mark.parametrize("field, value", [
    ("include_stop_str_in_output", "yes"), ("skip_special_tokens", 1), ("spaces_between_special_tokens", "no"),
])
def test_bad_values_are_400(stack, field, value):
    r = post(stack, "/v1/completions", {"prompt": PROMPT, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_truncate_prompt_tokens_keeps_the_last_tokens_or_the_first(stack, smollm_tokenizer):
    ids = smollm_tokenizer.encode(PROMPT)
    k = 6
    r = post(stack, "/v1/completions", {"prompt": PROMPT, "temperature": 0, "max_tokens": 8,
                                        "truncate_prompt_tokens": k})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == k
    same = post(stack, "/v1/completions", {"prompt": ids[-k:], "temperature": 0, "max_tokens": 8})
    assert r.json()["choices"][0]["text"] == same.json()["choices"][0]["text"]
    r = post(stack, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "truncate_prompt_tokens": k})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == k
    right = post(stack, "/v1/completions", {"prompt": PROMPT, "temperature": 0, "max_tokens": 8,
                                            "truncate_prompt_tokens": k, "truncation_side": "right"})
    assert right.status_code == 200 and right.json()["usage"]["prompt_tokens"] == k
    first = post(stack, "/v1/completions", {"prompt": ids[:k], "temperature": 0, "max_tokens": 8})
    assert right.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    too_big = post(stack, "/v1/completions", {"prompt": PROMPT, "truncate_prompt_tokens": 10**6})
    assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "truncate_prompt_tokens"
    assert "max_model_len" in too_big.json()["error"]["message"]


def test_continue_final_message_goes_on_with_the_assistants_words(stack, smollm_tokenizer, hf_smollm_greedy):
    """vLLM's continue_final_message: the prompt ends inside the assistant's message (as
    /tokenize says too), and the greedy continuation is transformers' on those ids."""
    messages = [*CHAT, {"role": "assistant", "content": "Hello! My name is"}]
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    r = httpx.post(stack.base_url + "/tokenize", json=body, timeout=60)
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    assert smollm_tokenizer.decode(ids, skip_special_tokens=False).endswith(
        "<|im_end|>\n<|im_start|>assistant\nHello! My name is")
    r = post(stack, "/v1/chat/completions", {**body, "temperature": 0, "max_tokens": 12})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    [(want, _)] = hf_smollm_greedy([ids], 12)
    assert len(want) == 12  # a continuation, not an end of turn
    assert r.json()["choices"][0]["message"]["content"] == smollm_tokenizer.decode(want, skip_special_tokens=True)
    refused = post(stack, "/v1/chat/completions", {"messages": messages, "continue_final_message": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "continue_final_message"


def test_return_token_ids(stack, smollm_tokenizer):
    """vLLM's return_token_ids: the prompt's ids (those /tokenize gives) and the output's,
    which decode to the text; streamed, the chunks' ids are the same ones."""
    ids = httpx.post(stack.base_url + "/tokenize", json={"messages": CHAT}, timeout=60).json()["tokens"]
    chat_body = {"messages": CHAT, "temperature": 0, "max_tokens": 12, "return_token_ids": True}
    r = post(stack, "/v1/chat/completions", chat_body)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["prompt_token_ids"] == ids
    [choice] = answer["choices"]
    assert len(choice["token_ids"]) == answer["usage"]["completion_tokens"]
    assert smollm_tokenizer.decode(choice["token_ids"], skip_special_tokens=True) == choice["message"]["content"]
    text, chunks = streamed(stack, "/v1/chat/completions", chat_body)
    assert text == choice["message"]["content"]
    assert [t for c in chunks for t in c.get("token_ids", [])] == choice["token_ids"]
    completion = complete(stack, return_token_ids=True, max_tokens=8)
    assert completion["prompt_token_ids"] == smollm_tokenizer.encode(PROMPT)
    assert smollm_tokenizer.decode(completion["token_ids"]) == completion["text"]
    # return_tokens_as_token_ids (a text setting both detokenizer replicas must know): the
    # logprobs name the very ids, the text is unchanged.
    as_ids = chat(stack, return_token_ids=True, return_tokens_as_token_ids=True, logprobs=True, top_logprobs=2,
                  max_tokens=12)
    assert as_ids["message"]["content"] == choice["message"]["content"]
    content = as_ids["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in as_ids["token_ids"]]
    assert all(top["token"].startswith("token_id:") for e in content for top in e["top_logprobs"])


def test_tokenize_and_detokenize(stack, smollm_tokenizer):
    r = httpx.post(stack.base_url + "/tokenize", json={"model": MODEL, "prompt": PROMPT, "return_token_strs": True},
                   timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    ids = smollm_tokenizer.encode(PROMPT)
    assert body["tokens"] == ids and body["count"] == len(ids)
    assert body["token_strs"] == smollm_tokenizer.convert_ids_to_tokens(ids)
    assert body["max_model_len"] > len(ids)
    # Messages: the same ids a chat request is prompted with.
    r = httpx.post(stack.base_url + "/tokenize", json={"messages": CHAT}, timeout=60)
    assert r.status_code == 200 and r.json()["token_strs"] is None
    used = post(stack, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1}).json()["usage"]
    assert r.json()["count"] == used["prompt_tokens"]
    no_prompt = httpx.post(stack.base_url + "/tokenize", json={"messages": CHAT, "add_generation_prompt": False},
                           timeout=60).json()
    assert no_prompt["tokens"] == r.json()["tokens"][:no_prompt["count"]] and no_prompt["count"] < r.json()["count"]
    r = httpx.post(stack.base_url + "/detokenize", json={"model": MODEL, "tokens": ids}, timeout=60)
    assert r.status_code == 200 and r.json() == {"prompt": PROMPT}
    eos = smollm_tokenizer.eos_token_id
    assert httpx.post(stack.base_url + "/detokenize", json={"tokens": [eos]}, timeout=60).json() == {
        "prompt": "<|im_end|>"}
    bad = httpx.post(stack.base_url + "/detokenize", json={"tokens": [10**9]}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_prompt_logprobs_in_vllm_shape(stack, smollm_tokenizer):
    ids = smollm_tokenizer.encode(PROMPT)
    choice = complete(stack, prompt_logprobs=2, max_tokens=2)
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for token_id, entry in zip(ids[1:], entries[1:]):
        assert str(token_id) in entry and entry[str(token_id)]["logprob"] <= 0
        assert entry[str(token_id)]["decoded_token"] == smollm_tokenizer.decode([token_id])
        others = [v["rank"] for k, v in entry.items() if k != str(token_id)]  # the top-2 but the token
        assert len(entry) in (2, 3) and set(others) <= {1, 2}
    assert "prompt_logprobs" not in complete(stack, max_tokens=2)
    r = post(stack, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "prompt_logprobs": 0})
    body = r.json()
    assert r.status_code == 200 and len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"]
    assert body["prompt_logprobs"][0] is None and all(len(e) == 1 for e in body["prompt_logprobs"][1:])
    for bad in ({"prompt_logprobs": 1, "stream": True}, {"prompt_logprobs": 21}, {"prompt_logprobs": -1}):
        r = post(stack, "/v1/completions", {"prompt": PROMPT, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text


def test_echo_with_logprobs_leads_with_the_prompt(stack, smollm_tokenizer):
    ids = smollm_tokenizer.encode(PROMPT)
    base = complete(stack, max_tokens=4, logprobs=1)
    echoed = complete(stack, max_tokens=4, logprobs=1, echo=True)
    assert echoed["text"] == PROMPT + base["text"]
    lp = echoed["logprobs"]
    assert lp["tokens"] == [smollm_tokenizer.decode([t]) for t in ids] + base["logprobs"]["tokens"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["text_offset"][len(ids)] == len(PROMPT)
    assert lp["token_logprobs"][len(ids):] == base["logprobs"]["token_logprobs"]
    # The prompt's logprobs are the prompt logprobs of the same prompt.
    reference = complete(stack, max_tokens=1, prompt_logprobs=1)["prompt_logprobs"]
    for i, token_id in enumerate(ids[1:], start=1):
        assert abs(lp["token_logprobs"][i] - reference[i][str(token_id)]["logprob"]) < 1e-4
    text, choices = streamed(stack, "/v1/completions", {"prompt": PROMPT, "temperature": 0, "max_tokens": 4,
                                                        "echo": True})
    assert text == PROMPT + base["text"] and choices[0]["text"].startswith(PROMPT)
