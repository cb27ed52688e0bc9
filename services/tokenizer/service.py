"""The tokenizer service: validate, render the chat template, tokenize, hand to a scheduler.

Second stop on the request's way (gateway -> tokenizer -> scheduler). The gateway
asks on ``llm.tokenize`` (queue group: replicas share the work); the service
prepares the request off the event loop (``shared.request_preparation``: checks the
sampling settings and the prompt, renders messages with the model's chat template,
tokenizes, checks the context length) and forwards the ``EngineRequest`` to a
scheduler: the one its router chooses (``services/router``: request/reply on that engine's
``llm.engine.<id>.requests``), or, when the router knows no ready engine or the chosen one
has no responder, any (the schedulers' queue group on ``llm.engine.requests``).
One ``TokenizeRequest`` is one prompt with its ``n`` samples: the prompt is prepared once,
and each sample goes to a scheduler as its own ``EngineRequest`` (own request id, seed + i). The gateway
gets a ``TokenizeReply``: the prompt length and each sample's answer (queued, or the
scheduler's error; 503 when none answers), or the prompt's refusal in OpenAI's shape
(400 for bad input).

Traced requests (``shared/tracing.py``: the tokenize request's NATS headers carry a
``traceparent`` and this process traces) get a ``tokenize`` span and, per sample, a
``route`` span around its hand-over to a scheduler, whose context goes in the engine
request's headers. Each engine that took a request is counted
(``natsllm:routed_requests_total{engine}``; the router's reasons reach the gateways'
``natsllm:router_decisions_total``).
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily

from services.router.bus import RouterOnBus
from services.router.config import RouterConfig
from services.router.router import Router
from shared import tracing
from shared.bus import NO_RESPONDERS_WINDOW, Service, respond
from shared.protocol import (
    DETOKENIZE_TOKENS_CHANNEL,
    ENGINE_REQUEST_CHANNEL,
    ENGINE_REQUESTS_CHANNEL,
    TOKENIZE_CHANNEL,
    TOKENIZE_TEXT_CHANNEL,
    Channel,
    DetokenizeTokensReply,
    EngineRequest,
    EngineRequestReply,
    ErrorInfo,
    TokenizeReply,
    TokenizeTextReply,
)
from shared.request_preparation import RequestPreparer
from shared.request_validation import InvalidRequest
from shared.service_metrics import counter
from shared.structured_output.validation import compile_cache_for
from shared.tracing import Attr

from .config import TokenizerConfig
from .tokens import detokenize_tokens, tokenize_text

logger = logging.getLogger(__name__)

NO_SCHEDULER = "no scheduler is available"
PREPARE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


def no_scheduler(engine_request: EngineRequest) -> EngineRequestReply:
    return EngineRequestReply(engine_request.request_id,
                              ErrorInfo(NO_SCHEDULER, type="service_unavailable", status=503))


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
        router_config: RouterConfig = RouterConfig(),
    ) -> None:
        super().__init__(nats_url)
        self.tokenizer = tokenizer
        # The tokenizer's EOS id first (the request's eos_token_id), then the model's others.
        eos_token_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        eos_token_ids += [i for i in extra_eos_token_ids or [] if i not in eos_token_ids]
        self.preparer = RequestPreparer(max_model_len, vocab_size, tuple(eos_token_ids),
                                        config.special_tokens_in_content)
        self.scheduler_timeout = config.scheduler_timeout
        self.structured_outputs_warmup = config.structured_outputs_warmup
        self.num_requests = 0
        self.num_rejected = 0
        self.routed: dict[str, int] = {}  # samples each engine's scheduler took
        self.prepare_seconds = Histogram("natsllm:tokenizer_prepare_seconds",
                                         "Seconds to validate, render and tokenize a prompt.",
                                         buckets=PREPARE_BUCKETS, registry=self.metrics_registry)
        self.tracing = tracing.current()
        self.router = Router(router_config)
        self.router_bus = RouterOnBus(self, self.router)

    def info(self) -> dict:
        return {
            "max_model_len": self.preparer.max_model_len,
            "num_requests": self.num_requests,
            "num_rejected": self.num_rejected,
            "router_mode": self.router.mode,
            "router_decisions": dict(self.router.decisions),
        }

    def metric_families(self):
        yield counter("natsllm:tokenizer_requests", "Prompts received.", self.num_requests)
        yield counter("natsllm:tokenizer_rejected", "Prompts refused (bad input, or no scheduler took them).",
                      self.num_rejected)
        routed = CounterMetricFamily("natsllm:routed_requests", "Samples this tokenizer handed to each engine "
                                     "(by its router's choice or the queue group's).", labels=["engine"])
        for engine_id, count in sorted(self.routed.items()):
            routed.add_metric([engine_id], float(count))
        yield routed

    async def setup(self) -> None:
        await self.subscribe(TOKENIZE_CHANNEL.subject(), self._on_tokenize, queue="tokenizer")
        await self.subscribe(TOKENIZE_TEXT_CHANNEL.subject(), self._on_tokenize_text, queue="tokenizer")
        await self.subscribe(DETOKENIZE_TOKENS_CHANNEL.subject(), self._on_detokenize_tokens, queue="tokenizer")
        await self.router_bus.setup()
        if self.structured_outputs_warmup:
            # The same cache the requests' checks use (shared/request_preparation.py).
            compile_cache_for(self.tokenizer, self.preparer.vocab_size).warm_up()

    async def _on_tokenize_text(self, msg: Msg) -> None:
        """vLLM's /tokenize (``tokens.py``): ids only, nothing scheduled."""
        self.spawn(self._answer(msg, TOKENIZE_TEXT_CHANNEL, TokenizeTextReply,
                                lambda request: tokenize_text(self.preparer, self.tokenizer, request)))

    async def _on_detokenize_tokens(self, msg: Msg) -> None:
        """vLLM's /detokenize (``tokens.py``)."""
        self.spawn(self._answer(msg, DETOKENIZE_TOKENS_CHANNEL, DetokenizeTokensReply,
                                lambda request: detokenize_tokens(self.preparer.vocab_size, self.tokenizer, request)))

    async def _answer(self, msg: Msg, channel: Channel, reply_type, work) -> None:
        """Decode, run ``work`` off the event loop, reply; a bad message or a failure is an
        error reply, never a dead handler."""
        try:
            reply = await asyncio.to_thread(work, channel.decode(msg.data))
        except msgspec.DecodeError as e:
            reply = reply_type(error=ErrorInfo(f"malformed request: {e}"))
        except Exception as e:
            logger.exception("%s failed", msg.subject)
            reply = reply_type(error=ErrorInfo(f"tokenizing failed: {e}", type="internal_error", status=500))
        if msg.reply:
            await respond(msg, channel, reply)

    async def _on_tokenize(self, msg: Msg) -> None:
        # One task per request: a long prompt never holds up the subject.
        self.spawn(self._handle(msg))

    async def _handle(self, msg: Msg) -> None:
        parent = self.tracing.context_from(msg.headers) if self.tracing is not None else None
        if parent is None:
            reply = await self.handle_request(msg.data)
        else:
            span = self.tracing.start("tokenize", parent, self.tracing.SERVER)
            reply = await self.handle_request(msg.data, span)
            span.set_attribute(Attr.PROMPT_TOKENS, reply.num_prompt_tokens)
            if reply.error is not None:
                self.tracing.fail(span, reply.error.message)
            span.end()
        if reply.error is not None or any(c.error is not None for c in reply.choices):
            self.num_rejected += 1
        if msg.reply:
            await respond(msg, TOKENIZE_CHANNEL, reply)
        else:
            logger.warning("tokenize request without a reply subject")

    async def handle_request(self, data: bytes, span=None) -> TokenizeReply:
        """The whole path for one encoded ``TokenizeRequest`` (one prompt, its n samples);
        never raises. ``span``: the request's tokenize span, when traced."""
        self.num_requests += 1
        try:
            request = TOKENIZE_CHANNEL.decode(data)
        except msgspec.DecodeError as e:
            logger.warning("malformed tokenize request: %s", e)
            return TokenizeReply(error=ErrorInfo(f"malformed request: {e}"))
        name = request.request_ids[0] if request.request_ids else "?"
        if span is not None:
            span.set_attributes({Attr.REQUEST_ID: name, Attr.REQUEST_MODEL: request.model,
                                 Attr.REQUEST_N: len(request.request_ids)})
        started = time.perf_counter()
        try:
            engine_requests = await asyncio.to_thread(self.preparer.prepare, request, self.tokenizer)
        except InvalidRequest as e:
            logger.info("%s: rejected: %s", name, e)
            return TokenizeReply(error=e.error)
        except Exception as e:
            logger.exception("%s: tokenizing failed", name)
            return TokenizeReply(error=ErrorInfo(f"tokenizing failed: {e}", type="internal_error", status=500))
        self.prepare_seconds.observe(time.perf_counter() - started)
        answers = await asyncio.gather(*(self.submit(r, span) for r in engine_requests))
        for answer in answers:
            if answer.error is None:
                self.routed[answer.engine_id] = self.routed.get(answer.engine_id, 0) + 1
        prompt = engine_requests[0].prompt_token_ids
        return TokenizeReply(len(prompt), choices=list(answers),
                             prompt_token_ids=prompt if request.return_prompt_token_ids else [])

    async def submit(self, engine_request: EngineRequest, parent_span=None) -> EngineRequestReply:
        """Hand one sample to a scheduler: its answer (the engine that queued the request,
        or its refusal), or a 503 when none answers. Traced (``parent_span``): in a route
        span whose context the scheduler continues."""
        if parent_span is None:
            return await self._submit(engine_request)
        tracer = self.tracing
        span = tracer.start("route", tracer.context_of(parent_span), tracer.CLIENT,
                            attributes={Attr.REQUEST_ID: engine_request.request_id})
        reply = await self._submit(engine_request, tracer.headers(span))
        span.set_attribute(Attr.ENGINE, reply.engine_id)
        if reply.error is not None:
            tracer.fail(span, reply.error.message)
        span.end()
        return reply

    async def _submit(self, engine_request: EngineRequest, headers: dict[str, str] | None = None) -> EngineRequestReply:
        """The router's engine first; the queue group when the router knows no ready engine,
        or that engine has no responder (it died: another takes the request; in the queue
        group no responder is asked again for a moment: ``shared.bus.NO_RESPONDERS_WINDOW``).
        After a timeout the request may be queued after all (only the answer was lost): the
        gateway aborts a sample refused with 503. A router just started first waits to hear
        the engines (``RouterOnBus.settled``, 3 s at most)."""
        await self.router_bus.settled()
        route = self.router.route(engine_request)
        if route is not None:
            try:
                reply = await self.request(ENGINE_REQUEST_CHANNEL, engine_request, route.engine_id,
                                           timeout=self.scheduler_timeout, headers=headers)
            except NoRespondersError:
                self.router.answered(route, 0)
                logger.warning("%s: engine %s has no responder; any scheduler may take it", engine_request.request_id,
                               route.engine_id)
            except (NatsTimeoutError, asyncio.TimeoutError):
                # It may still have queued the request: not offered to another engine.
                logger.warning("%s: engine %s did not answer within %.1fs", engine_request.request_id,
                               route.engine_id, self.scheduler_timeout)
                return no_scheduler(engine_request)
            else:
                self.router.answered(route, reply.admission if reply.error is None else 0)
                return reply
        try:
            return await self.request(ENGINE_REQUESTS_CHANNEL, engine_request, timeout=self.scheduler_timeout,
                                      no_responders_window=NO_RESPONDERS_WINDOW, headers=headers)
        except NoRespondersError:
            logger.warning("%s: %s (no responders)", engine_request.request_id, NO_SCHEDULER)
            return no_scheduler(engine_request)
        except (NatsTimeoutError, asyncio.TimeoutError):
            logger.warning(
                "%s: %s (no answer within %.1fs)", engine_request.request_id, NO_SCHEDULER, self.scheduler_timeout
            )
            return no_scheduler(engine_request)
