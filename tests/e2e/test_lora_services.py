"""LoRA adapters through the whole stack (authenticated bus, API key) with the ``openai`` client.

One adapter is served from the start (``--lora-modules``), another is loaded at runtime over
HTTP; with ``--max-loras 1`` requests under both and the base model run concurrently (the
scheduler admits one adapter at a time and the worker swaps its slot). Each greedy answer
equals Hugging Face + PEFT's for its adapter; unload makes the name a 404.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from tests.e2e.stacks import replicated_config, running_stack, wait_until
from tests.lora_reference import make_peft_adapter

MODEL = "SmolLM2-135M-Instruct"
API_KEY = "lora-test-key"
QUESTION = [{"role": "user", "content": "Write one sentence about cats."}]
GREEDY = {"temperature": 0.0, "max_tokens": 16, "extra_body": {"ignore_eos": True}}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def adapters(hf_smollm, tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    return {
        "first": make_peft_adapter(hf_smollm, root / "first", rank=8, alpha=16, targets=TARGETS, seed=1, b_std=0.06),
        "second": make_peft_adapter(hf_smollm, root / "second", rank=16, alpha=8, targets=["q_proj", "v_proj",
                                    "down_proj"], use_rslora=True, seed=2, b_std=0.05),
        "too-big": make_peft_adapter(hf_smollm, root / "too-big", rank=32, alpha=8, targets=["q_proj"]),
    }


@pytest.fixture(scope="module")
def stack(tmp_path_factory, adapters):
    args = ["--quantization", "none", "--enable-lora", "--max-loras", "1", "--max-lora-rank", "16", "--lora-modules",
            f"first={adapters['first']}", "--api-key", API_KEY, "--num-gpu-blocks", "256",
            "--max-num-batched-tokens", "256"]
    with running_stack(replicated_config(tmp_path_factory.mktemp("stack-logs"), args)) as stack:
        yield stack


@pytest.fixture(scope="module")
def client(stack):
    return AsyncOpenAI(base_url=stack.base_url + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def refs(hf_smollm_greedy, hf_lora_greedy, smollm_tokenizer, adapters):
    """HF (+ PEFT) greedy text of the question under the base model and each adapter."""
    prompt = smollm_tokenizer.encode(smollm_tokenizer.apply_chat_template(QUESTION), add_special_tokens=False)
    tokens = {MODEL: hf_smollm_greedy([prompt], 16, stop_at_eos=False)[0][0],
              **{name: hf_lora_greedy(adapters[name], [prompt], 16, stop_at_eos=False)[0][0]
                 for name in ("first", "second")}}
    return {name: smollm_tokenizer.decode(ids).rstrip("\ufffd") for name, ids in tokens.items()}


def lora_info(stack) -> str:
    lines = httpx.get(stack.base_url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=10).text.splitlines()
    return next((line for line in lines if line.startswith("natsllm:lora_requests_info{")), "")


def post(stack, path, body, key=API_KEY):
    return httpx.post(stack.base_url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30)


async def answer(client, model):
    response = await client.chat.completions.create(model=model, messages=QUESTION, **GREEDY)
    assert response.model == model
    return response.choices[0].message.content


async def test_load_list_use_unload(stack, client, adapters, refs):
    assert len(set(refs.values())) == 3  # each adapter changes the answer
    models = {m.id: m for m in (await client.models.list()).data}
    assert set(models) == {MODEL, "first"} and models["first"].parent == MODEL

    # Refused loads: no key, a bad path, a rank above --max-lora-rank, a name in use.
    r = post(stack, "/v1/load_lora_adapter", {"lora_name": "second", "lora_path": str(adapters["second"])}, key="no")
    assert r.status_code == 401
    r = post(stack, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nonexistent"})
    assert r.status_code == 400 and "is not a directory" in r.json()["error"]["message"]
    r = post(stack, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(adapters["too-big"])})
    assert r.status_code == 400 and "greater than max_lora_rank 16" in r.json()["error"]["message"]
    r = post(stack, "/v1/load_lora_adapter", {"lora_name": "first", "lora_path": str(adapters["second"])})
    assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]
    # The one slot (--max-loras 1) cannot be pinned while "first" (unpinned) needs it.
    r = post(stack, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(adapters["second"]), "pinned": True})
    assert r.status_code == 400 and "do not fit max_loras 1 slots" in r.json()["error"]["message"]
    r = post(stack, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(adapters["second"]), "pinned": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "pinned"

    r = post(stack, "/v1/load_lora_adapter", {"lora_name": "second", "lora_path": str(adapters["second"])})
    assert r.status_code == 200, r.text
    models = {m.id: m for m in (await client.models.list()).data}
    assert set(models) == {MODEL, "first", "second"} and models["second"].parent == MODEL

    # Both adapters and the base model at once, twice each: one adapter slot.
    names = [MODEL, "first", "second"] * 2
    answers = await asyncio.gather(*(answer(client, name) for name in names))
    assert answers == [refs[name] for name in names]

    # vLLM's lora_requests_info names the adapter while its request runs.
    long = asyncio.create_task(client.chat.completions.create(
        model="second", messages=QUESTION, temperature=0.0, max_tokens=128, extra_body={"ignore_eos": True}))
    await asyncio.to_thread(wait_until, lambda: 'running_lora_adapters="second"' in lora_info(stack), 60,
                            "lora_requests_info never named the running adapter")
    assert lora_info(stack).startswith('natsllm:lora_requests_info{max_lora="1",')
    await long

    r = post(stack, "/v1/unload_lora_adapter", {"lora_name": "second"})
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError) as error:
        await answer(client, "second")
    assert error.value.body["code"] == "model_not_found"
    r = post(stack, "/v1/unload_lora_adapter", {"lora_name": "second"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert {m.id for m in (await client.models.list()).data} == {MODEL, "first"}
    assert await answer(client, "first") == refs["first"]
