"""LoRA adapters at the gateway: which ones it serves, and the routes that change that.

    POST /v1/load_lora_adapter    {"lora_name", "lora_path"}   (vLLM's endpoint and fields;
                                  "pinned": true keeps it in the workers' slots for good;
                                  vLLM's "load_inplace" only as false)
    POST /v1/unload_lora_adapter  {"lora_name"}   (vLLM's "lora_int_id" only as null)

Any other body field is refused with a 400 naming it, never ignored.

Each gateway keeps a registry, name -> ``LoRARequest`` (name and PEFT folder or GGUF LoRA
file), filled from ``--lora-modules`` at start, from the other gateways' registries (asked
on ``LORA_LIST`` at start, with a deadline) and from every change a gateway broadcasts on
``LORA_ADAPTERS``. A request whose ``model`` is an adapter's name carries that
``LoRARequest`` to the tokenizer, the scheduler and, once, to the workers, which read the
folder themselves: no other service keeps a registry. Loading checks the folder against the
base model (``shared.lora.check_lora_adapter``, a GGUF file by its header: bad path, rank
above --max-lora-rank, a shape the model lacks -> 400) before anything is broadcast. A
request already running under an adapter that is unloaded finishes; the workers drop it from
their slots by LRU.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging

from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from shared.config import LoRAConfig
from shared.lora import check_lora_adapter, check_pinning
from shared.lora_shapes import LoRAAdapterError
from shared.model_config import ModelConfig
from shared.bus import respond
from shared.protocol import LORA_ADAPTERS_CHANNEL, LORA_LIST_CHANNEL, LoRAAdapters, LoRARequest

from .errors import ApiError, error_response
from .json_body import read_json

logger = logging.getLogger(__name__)

# How long a starting gateway waits for another gateway's list of adapters.
LIST_TIMEOUT_S = 1.0


class LoRARegistry:
    """The adapters this gateway serves, by name."""

    def __init__(self, config: LoRAConfig, model_path: str) -> None:
        self.config = config
        self.model_path = model_path
        self.adapters: dict[str, LoRARequest] = {}
        for lora in config.modules():
            self.check(lora.lora_path)
            self.adapters[lora.lora_name] = lora

    @functools.cached_property
    def model_config(self) -> ModelConfig:
        from shared.model_files import default_model_path, load_model_config

        return load_model_config(self.model_path or default_model_path())

    def check(self, path: str) -> None:
        """Raises ``LoRAAdapterError`` if the folder cannot be served on the base model."""
        check_lora_adapter(path, self.model_config, self.config.max_lora_rank)

    def check_pinning_with(self, lora: LoRARequest) -> None:
        """Raises ``LoRAAdapterError`` if adding ``lora`` would pin more adapters than fit."""
        check_pinning([*self.adapters.values(), lora], self.config.max_loras)

    def lookup(self, model: object) -> LoRARequest | None:
        return self.adapters.get(model) if isinstance(model, str) else None

    def apply(self, change: LoRAAdapters) -> None:
        for name in change.unloaded:
            self.adapters.pop(name, None)
        for lora in change.loaded:
            self.adapters[lora.lora_name] = lora

    def listing(self) -> LoRAAdapters:
        return LoRAAdapters(loaded=list(self.adapters.values()))


async def join_lora_bus(service, registry: LoRARegistry) -> None:
    """Take the adapters the running gateways serve (none answer: only --lora-modules), then
    follow every change and answer the next gateway that asks. A lost change message leaves
    this gateway without that adapter (404) or still listing an unloaded one (its requests
    then still run: the workers read the folder)."""
    try:
        registry.apply(await service.request(LORA_LIST_CHANNEL, b"", timeout=LIST_TIMEOUT_S))
    except (NoRespondersError, NatsTimeoutError):
        pass

    async def on_change(msg) -> None:
        registry.apply(LORA_ADAPTERS_CHANNEL.decode(msg.data))

    async def on_list(msg) -> None:
        await respond(msg, LORA_LIST_CHANNEL, registry.listing())

    await service.subscribe(LORA_ADAPTERS_CHANNEL.subject(), on_change)
    await service.subscribe(LORA_LIST_CHANNEL.subject(), on_list)


def with_lora_adapter(gateway, body, parse):
    """``parse(body, served names)``, where ``body``'s model may also name a LoRA adapter: the
    request then carries its ``LoRARequest`` and the response reports the adapter's name."""
    names = gateway.config.served_model_names
    lora = gateway.lora.lookup(body.get("model")) if gateway.lora is not None and isinstance(body, dict) else None
    if lora is None:
        return parse(body, names)
    parsed = parse(body, (*names, lora.lora_name))
    return dataclasses.replace(parsed, model=lora.lora_name, lora_request=lora)


# The body fields each route honours; vLLM's fields we cannot honour pass only as their no-op
# value (field -> that value), anything else is refused by ``_check_fields``.
LOAD_FIELDS = frozenset({"lora_name", "lora_path", "pinned"})
LOAD_NO_OP_FIELDS = {"load_inplace": False}
UNLOAD_FIELDS = frozenset({"lora_name"})
UNLOAD_NO_OP_FIELDS = {"lora_int_id": None}


def _check_fields(body: dict, honoured: frozenset, no_op: dict) -> None:
    for name, value in body.items():
        if name in honoured or (name in no_op and value is no_op[name]):
            continue
        if name == "load_inplace" and name in no_op and value is True:
            raise ApiError("'load_inplace': true is not supported (no in-place reload): unload the adapter, "
                           "then load it again", param=name)
        if name in no_op:
            raise ApiError(f"'{name}' is only accepted as {json.dumps(no_op[name])}", param=name)
        raise ApiError(f"unsupported field '{name}'", param=name)


def _name_field(body: dict, name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value:
        raise ApiError(f"'{name}' must be a non-empty string", param=name)
    return value


class LoRARoutes:
    """The two endpoints (each change is broadcast on ``LORA_ADAPTERS``) and the model cards."""

    def __init__(self, gateway) -> None:
        self.gateway = gateway

    def _registry(self) -> LoRARegistry:
        registry = self.gateway.lora
        if registry is None:
            raise ApiError("LoRA adapters are not enabled on this server (start it with --enable-lora)")
        return registry

    async def _body(self, request: Request) -> dict:
        body = await read_json(request, self.gateway.config.max_request_body_bytes)
        if not isinstance(body, dict):
            raise ApiError("the request body must be a JSON object")
        return body

    async def _publish(self, change: LoRAAdapters) -> None:
        await self.gateway.publish(LORA_ADAPTERS_CHANNEL, change)

    def model_cards(self, card) -> list[dict]:
        """``GET /v1/models`` entries of the adapters: ``card(name)`` with vLLM's root and parent."""
        registry = self.gateway.lora
        if registry is None:
            return []
        parent = self.gateway.config.model_name
        return [{**card(lora.lora_name), "root": lora.lora_path, "parent": lora.base_model_name or parent}
                for lora in registry.adapters.values()]

    async def load(self, request: Request) -> Response:
        try:
            registry = self._registry()
            body = await self._body(request)
            _check_fields(body, LOAD_FIELDS, LOAD_NO_OP_FIELDS)
            name, path = _name_field(body, "lora_name"), _name_field(body, "lora_path")
            pinned = body.get("pinned", False)
            if not isinstance(pinned, bool):
                raise ApiError("'pinned' must be a boolean", param="pinned")
            if name in registry.adapters or name in self.gateway.config.served_model_names:
                raise ApiError(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
            lora = LoRARequest(name, path, pinned=pinned)
            try:
                registry.check_pinning_with(lora)
            except LoRAAdapterError as e:
                raise ApiError(str(e), param="pinned") from None
            try:
                # Reads a config and a header only, but from disk: not on the event loop.
                await asyncio.get_running_loop().run_in_executor(None, registry.check, path)
            except LoRAAdapterError as e:
                raise ApiError(str(e), param="lora_path") from None
            change = LoRAAdapters(loaded=[lora])
            registry.apply(change)
            await self._publish(change)
        except ApiError as e:
            return error_response(e.info)
        logger.info("LoRA adapter %r loaded from %s%s", name, path, " (pinned)" if pinned else "")
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: Request) -> Response:
        try:
            registry = self._registry()
            body = await self._body(request)
            _check_fields(body, UNLOAD_FIELDS, UNLOAD_NO_OP_FIELDS)
            name = _name_field(body, "lora_name")
            if name not in registry.adapters:
                raise ApiError(f"The lora adapter '{name}' cannot be found.", status=404, type="not_found_error",
                               param="lora_name")
            change = LoRAAdapters(unloaded=[name])
            registry.apply(change)
            await self._publish(change)
        except ApiError as e:
            return error_response(e.info)
        logger.info("LoRA adapter %r unloaded", name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
