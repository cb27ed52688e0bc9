"""The tokenizer service: validate, render the chat template, tokenize, hand to a scheduler.

Second stop on the request's way (gateway -> tokenizer -> scheduler). The gateway
asks on ``llm.tokenize`` (queue group: replicas share the work); the service checks
the sampling settings and the prompt, turns messages into the model's prompt text
with its chat template, tokenizes it off the event loop, checks the context length,
and forwards an ``EngineRequest`` to a scheduler (request/reply on
``llm.engine.requests``). The gateway gets a ``TokenizeReply``: the prompt length,
or an error in OpenAI's shape (400 for bad input, 503 when no scheduler answers,
or the scheduler's own error).
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from shared.bus import Service
from shared.protocol import (
    ENGINE_REQUEST,
    ENGINE_REQUEST_REPLY,
    ENGINE_REQUESTS,
    TOKENIZE,
    TOKENIZE_REPLY,
    TOKENIZE_REQUEST,
    EngineRequest,
    ErrorInfo,
    TokenizeReply,
    TokenizeRequest,
)

from .config import TokenizerConfig
from .validation import (
    InvalidRequest,
    chat_messages,
    resolve_max_tokens,
    validate_request_shape,
    validate_sampling_params,
)

logger = logging.getLogger(__name__)

NO_SCHEDULER = "no scheduler is available"


class TokenizerService(Service):
    name = "tokenizer"

    def __init__(
        self,
        tokenizer,
        max_model_len: int,
        vocab_size: int,
        extra_eos_token_ids: list[int] | None = None,
        config: TokenizerConfig = TokenizerConfig(),
        nats_url: str | None = None,
    ) -> None:
        super().__init__(nats_url)
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        # The model's end-of-sequence ids besides the tokenizer's: they stop generation
        # too (as vLLM does with generation_config's eos_token_id list).
        self.extra_eos_token_ids = [
            i for i in (extra_eos_token_ids or []) if i != tokenizer.eos_token_id
        ]
        self.scheduler_timeout = config.scheduler_timeout
        self.num_requests = 0
        self.num_rejected = 0

    def info(self) -> dict:
        return {
            "max_model_len": self.max_model_len,
            "num_requests": self.num_requests,
            "num_rejected": self.num_rejected,
        }

    async def setup(self) -> None:
        await self.subscribe(TOKENIZE, self._on_tokenize, queue="tokenizer")

    async def _on_tokenize(self, msg: Msg) -> None:
        # One task per request: a long prompt never holds up the subject.
        self.spawn(self._handle(msg))

    async def _handle(self, msg: Msg) -> None:
        reply = await self.handle_request(msg.data)
        if reply.error is not None:
            self.num_rejected += 1
        if msg.reply:
            await msg.respond(TOKENIZE_REPLY.encode(reply))
        else:
            logger.warning("%s: tokenize request without a reply subject", reply.request_id)

    async def handle_request(self, data: bytes) -> TokenizeReply:
        """The whole path for one encoded ``TokenizeRequest``; never raises."""
        self.num_requests += 1
        try:
            request = TOKENIZE_REQUEST.decode(data)
        except msgspec.DecodeError as e:
            logger.warning("malformed tokenize request: %s", e)
            return TokenizeReply("", error=ErrorInfo(f"malformed request: {e}"))
        try:
            engine_request = await asyncio.to_thread(self.prepare, request)
        except InvalidRequest as e:
            logger.info("%s: rejected: %s", request.request_id, e)
            return TokenizeReply(request.request_id, error=e.error)
        except Exception as e:
            logger.exception("%s: tokenizing failed", request.request_id)
            return TokenizeReply(
                request.request_id,
                error=ErrorInfo(f"tokenizing failed: {e}", type="internal_error", status=500),
            )
        error = await self.submit(engine_request)
        return TokenizeReply(request.request_id, len(engine_request.prompt_token_ids), error)

    def prepare(self, request: TokenizeRequest) -> EngineRequest:
        """Validate and tokenize (CPU work: runs in a thread). Raises ``InvalidRequest``."""
        params = validate_sampling_params(request.sampling_params, self.vocab_size)
        validate_request_shape(request, self.vocab_size)
        if request.messages is not None:
            prompt_param = "messages"
            prompt_token_ids = self.tokenize_chat(request.messages, request.add_generation_prompt)
        elif request.prompt is not None:
            prompt_param = "prompt"
            prompt_token_ids = self.tokenizer.encode(request.prompt, add_special_tokens=True)
        else:
            prompt_param = "prompt_token_ids"
            prompt_token_ids = list(request.prompt_token_ids)
        params = resolve_max_tokens(params, len(prompt_token_ids), self.max_model_len, prompt_param)
        if self.extra_eos_token_ids and not params.ignore_eos:
            stop_ids = params.stop_token_ids + [i for i in self.extra_eos_token_ids if i not in params.stop_token_ids]
            params = msgspec.structs.replace(params, stop_token_ids=stop_ids)
        return EngineRequest(
            request_id=request.request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            arrival_time=time.time(),
            eos_token_id=self.tokenizer.eos_token_id,
            gateway_id=request.gateway_id,
            cache_salt=request.cache_salt,
        )

    def tokenize_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """The chat prompt's ids, as transformers' ``apply_chat_template(tokenize=True)``:
        the rendered text already holds the special tokens, so none are added."""
        messages = chat_messages(messages)
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        except Exception as e:  # the template's raise_exception, or a template that needs fields we lack
            raise InvalidRequest(f"the chat template cannot render these messages: {e}", param="messages") from e
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def submit(self, engine_request: EngineRequest) -> ErrorInfo | None:
        """Hand the request to a scheduler; its refusal, or a 503 when none answers."""
        try:
            msg = await self.nc.request(
                ENGINE_REQUESTS, ENGINE_REQUEST.encode(engine_request), timeout=self.scheduler_timeout
            )
        except NoRespondersError:
            logger.warning("%s: %s (no responders)", engine_request.request_id, NO_SCHEDULER)
            return ErrorInfo(NO_SCHEDULER, type="service_unavailable", status=503)
        except (NatsTimeoutError, asyncio.TimeoutError):
            logger.warning(
                "%s: %s (no answer within %.1fs)", engine_request.request_id, NO_SCHEDULER, self.scheduler_timeout
            )
            return ErrorInfo(NO_SCHEDULER, type="service_unavailable", status=503)
        return ENGINE_REQUEST_REPLY.decode(msg.data).error
