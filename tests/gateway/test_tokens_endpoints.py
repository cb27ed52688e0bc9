"""/tokenize and /detokenize at the gateway: shapes checked at the edge, 503 without a tokenizer.

The module's fake engine answers only ``llm.tokenize``: nothing serves
``llm.tokenizer.tokenize``, so a well-formed call is a 503 (the real service's answers
are tested in tests/e2e/test_request_fields.py and tests/tokenizer).
"""

from __future__ import annotations

import pytest

from .conftest import MODEL


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": []}, "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"messages": "hi"}, "messages"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
     "continue_final_message"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{x}}"}, "chat_template"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": ["a"]}, "tokens"),
])
async def test_bad_bodies_are_400_naming_the_field(http, path, body, param):
    r = await http.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


async def test_an_unknown_model_is_404(http):
    r = await http.post("/tokenize", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text


@pytest.mark.parametrize("path, body", [
    ("/tokenize", {"model": MODEL, "prompt": "x"}), ("/detokenize", {"tokens": [1]}),
])
async def test_no_tokenizer_is_503(http, path, body):
    r = await http.post(path, json=body)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["type"] == "service_unavailable"


async def test_inert_chat_fields_pass_to_the_tokenizer(http):
    body = {"messages": [{"role": "user", "content": "x"}], "continue_final_message": False, "tools": None}
    assert (await http.post("/tokenize", json=body)).status_code == 503  # past the checks, no tokenizer
    r = await http.post("/tokenize", json={**body, "continue_final_message": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
    continuing = {**body, "continue_final_message": True, "add_generation_prompt": False}
    assert (await http.post("/tokenize", json=continuing)).status_code == 503
