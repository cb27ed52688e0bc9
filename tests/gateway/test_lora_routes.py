"""The LoRA routes' request bodies at an in-process gateway (fake engine): vLLM's fields we
cannot honour pass only as their no-op value (``load_inplace: false``, ``lora_int_id: null``);
``load_inplace: true`` and any unknown field are refused with a 400 naming the field, before
anything is loaded or unloaded."""

from __future__ import annotations

import httpx
import pytest
import torch
from safetensors.torch import save_file

from services.gateway.uvicorn_runner import GatewayServer
from shared.config import LoRAConfig
from shared.lora_shapes import ProjectionShapes
from shared.model_config import default_model_path, load_model_config

from tests.lora_reference import write_gguf_lora

from .conftest import gateway_config, until_engine_ready


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    """A rank-2 PEFT folder for the default model: q_proj of layer 0 only."""
    shapes = ProjectionShapes.of(load_model_config(default_model_path()))
    folder = tmp_path_factory.mktemp("adapter")
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{prefix}.lora_A.weight": torch.zeros(2, shapes.in_features["qkv"]),
               f"{prefix}.lora_B.weight": torch.zeros(shapes.out_features["qkv"][0], 2)},
              str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(
        '{"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}')
    return str(folder)


@pytest.fixture(scope="module")
async def http(nats_server, fake):
    config = gateway_config(lora=LoRAConfig(enable_lora=True, max_loras=2))
    async with GatewayServer(config, nats_url=nats_server.url) as server:
        await until_engine_ready(server)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=10) as client:
            yield client


async def adapter_names(http) -> set[str]:
    return {card["id"] for card in (await http.get("/v1/models")).json()["data"] if card.get("parent")}


def assert_refused(response, param: str, words: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert words in error["message"]


async def test_load_and_unload_accept_vllms_no_op_values(http, adapter):
    r = await http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": adapter, "load_inplace": False,
                                                       "pinned": False})
    assert r.status_code == 200, r.text
    assert await adapter_names(http) == {"a"}
    r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "a", "lora_int_id": None})
    assert r.status_code == 200, r.text
    assert await adapter_names(http) == set()


@pytest.mark.parametrize("extra, param, words", [
    ({"load_inplace": True}, "load_inplace", "unload the adapter, then load it again"),
    ({"load_inplace": 0}, "load_inplace", "only accepted as false"),
    ({"base_model_name": "x"}, "base_model_name", "unsupported field 'base_model_name'"),
    ({"lora_int_id": None}, "lora_int_id", "unsupported field 'lora_int_id'"),
])
async def test_load_refuses_fields_it_cannot_honour(http, adapter, extra, param, words):
    r = await http.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": adapter, **extra})
    assert_refused(r, param, words)
    assert await adapter_names(http) == set()


@pytest.mark.parametrize("extra, param, words", [
    ({"lora_int_id": 1}, "lora_int_id", "only accepted as null"),
    ({"lora_path": "/x"}, "lora_path", "unsupported field 'lora_path'"),
    ({"load_inplace": False}, "load_inplace", "unsupported field 'load_inplace'"),
])
async def test_unload_refuses_fields_it_cannot_honour(http, adapter, extra, param, words):
    assert (await http.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": adapter})).status_code == 200
    r = await http.post("/v1/unload_lora_adapter", json={"lora_name": "c", **extra})
    assert_refused(r, param, words)
    assert await adapter_names(http) == {"c"}
    assert (await http.post("/v1/unload_lora_adapter", json={"lora_name": "c"})).status_code == 200


async def test_gguf_lora_files_load_and_other_ggufs_are_refused(http, adapter, tmp_path):
    """A GGUF LoRA file is a ``lora_path`` as a PEFT folder is; the base model's own GGUF
    (no adapter) is a 400 that says so."""
    config = load_model_config(default_model_path())
    file = write_gguf_lora(adapter, tmp_path / "a.gguf", num_heads=config.num_attention_heads,
                           num_kv_heads=config.num_key_value_heads)
    r = await http.post("/v1/load_lora_adapter", json={"lora_name": "g", "lora_path": str(file)})
    assert r.status_code == 200, r.text
    cards = {card["id"]: card for card in (await http.get("/v1/models")).json()["data"]}
    assert cards["g"]["root"] == str(file)
    assert (await http.post("/v1/unload_lora_adapter", json={"lora_name": "g"})).status_code == 200
    r = await http.post("/v1/load_lora_adapter", json={"lora_name": "base", "lora_path": default_model_path()})
    assert_refused(r, "lora_path", "is not a LoRA adapter: general.type is 'model', not 'adapter'")
    assert await adapter_names(http) == set()
