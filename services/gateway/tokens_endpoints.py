"""``POST /tokenize`` and ``POST /detokenize``, vLLM's shapes; nothing is scheduled.

The gateway holds no tokenizer: each call is one request/reply to the tokenizer
service's queue group (``llm.tokenizer.tokenize`` / ``llm.tokenizer.detokenize``,
answered by ``services/tokenizer/tokens.py``) within ``tokenize_timeout``; no
tokenizer subscribed, or none answering in time, is a 503.

    /tokenize    {"prompt": str} or {"messages": [...]}, "add_special_tokens",
                 "add_generation_prompt" (messages), "return_token_strs"
                 -> {"count", "max_model_len", "tokens", "token_strs"}
    /detokenize  {"tokens": [int]} -> {"prompt"}

``add_special_tokens`` defaults to true for a prompt and false for messages, as in vLLM.
Chat fields we do not honour here (``continue_final_message``, ``chat_template``,
``chat_template_kwargs``, ``tools``) are a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import logging

from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from starlette.requests import Request
from starlette.responses import Response

from shared.protocol import (
    DETOKENIZE_TOKENS_CHANNEL,
    TOKENIZE_TEXT_CHANNEL,
    Channel,
    DetokenizeTokensRequest,
    TokenizeTextRequest,
)

from .bus_client import GatewayService
from .errors import ApiError, error_response, invalid, json_response
from .http_endpoints import CLIENT_CLOSED
from .json_body import ClientGone, read_json
from .openai_requests import Fields, chat_messages, check_model, generation_prompt_fields

logger = logging.getLogger(__name__)

# Chat-tokenize fields of vLLM's that this server does not honour (null asks for nothing).
_UNSUPPORTED_CHAT_FIELDS = ("chat_template", "chat_template_kwargs", "tools")


def parse_tokenize(body, served_model_names: tuple[str, ...]) -> TokenizeTextRequest:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    f = Fields(body)
    check_model(f, served_model_names)
    return_token_strs = f.bool("return_token_strs", False)
    if "messages" in body:
        if "prompt" in body:
            raise invalid("give either prompt or messages, not both", param="prompt")
        for name in _UNSUPPORTED_CHAT_FIELDS:
            if f.has(name):
                raise invalid(f"{name} is not supported by /tokenize on this server", param=name)
        add_generation_prompt, continue_final_message = generation_prompt_fields(f)
        return TokenizeTextRequest(
            messages=chat_messages(body["messages"]),
            add_special_tokens=f.bool("add_special_tokens", False),
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            return_token_strs=return_token_strs,
        )
    if not isinstance(body.get("prompt"), str):
        raise invalid("prompt (a string) or messages is required", param="prompt")
    return TokenizeTextRequest(prompt=body["prompt"], add_special_tokens=f.bool("add_special_tokens", True),
                               return_token_strs=return_token_strs)


def parse_detokenize(body, served_model_names: tuple[str, ...]) -> DetokenizeTokensRequest:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    f = Fields(body)
    check_model(f, served_model_names)
    if not isinstance(body.get("tokens"), list):
        raise invalid("tokens (a list of token ids) is required", param="tokens")
    return DetokenizeTokensRequest(f.int_list("tokens"))


class TokenEndpoints:
    def __init__(self, gateway: GatewayService) -> None:
        self.gateway = gateway

    async def tokenize(self, request: Request) -> Response:
        async def run(body) -> dict:
            ask = parse_tokenize(body, self.gateway.config.served_model_names)
            reply = await self._ask(TOKENIZE_TEXT_CHANNEL, ask)
            return {"count": len(reply.tokens), "max_model_len": reply.max_model_len, "tokens": reply.tokens,
                    "token_strs": reply.token_strs}

        return await self._handle(request, run)

    async def detokenize(self, request: Request) -> Response:
        async def run(body) -> dict:
            ask = parse_detokenize(body, self.gateway.config.served_model_names)
            reply = await self._ask(DETOKENIZE_TOKENS_CHANNEL, ask)
            return {"prompt": reply.prompt}

        return await self._handle(request, run)

    async def _handle(self, request: Request, run) -> Response:
        try:
            body = await read_json(request, self.gateway.config.max_request_body_bytes)
            return json_response(await run(body))
        except ApiError as e:
            return error_response(e.info)
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)

    async def _ask(self, channel: Channel, ask):
        """One request/reply to a tokenizer replica; its error as an ``ApiError``."""
        timeout = self.gateway.config.tokenize_timeout
        try:
            reply = await self.gateway.request(channel, ask, timeout=timeout)
        except NoRespondersError:
            raise ApiError("no tokenizer service is available", status=503, type="service_unavailable") from None
        except (NatsTimeoutError, asyncio.TimeoutError):
            logger.warning("no tokenizer answered %s within %.1fs", channel.subject(), timeout)
            raise ApiError(f"no tokenizer service answered within {timeout:g}s", status=503,
                           type="service_unavailable") from None
        except NatsError as e:
            raise ApiError(f"the message bus is unavailable: {e!r}", status=503, type="service_unavailable") from None
        if reply.error is not None:
            raise ApiError.from_info(reply.error)
        return reply
