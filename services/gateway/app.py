"""The gateway's HTTP routes (Starlette): the OpenAI API, /health and /metrics.

    POST /v1/chat/completions   chat, streamed (SSE) or not
    POST /v1/completions        completions, streamed (SSE) or not
    POST /tokenize              vLLM's: a prompt or messages -> token ids (tokens_endpoints.py)
    POST /detokenize            vLLM's: token ids -> text
    GET  /v1/models             the served model name(s)
    GET  /v1/models/{model}
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter   (``lora_routes.py``)
    GET  /health                200 when a tokenizer answers a ping and an engine is ready, else 503
    GET  /ping                  the same (vLLM's alias; POST too)
    GET  /metrics               Prometheus text
    GET  /dashboard             a live status page of the fleet (``dashboard.py``)

With an API key set, every ``/v1`` route, ``/tokenize``, ``/detokenize``, ``/metrics`` and
``/dashboard`` (those two unless ``--metrics-public``) need ``Authorization: Bearer <key>``;
``/metrics`` and ``/dashboard`` also take HTTP Basic with the key as the password (a browser
asks for it: the page's event stream cannot send a bearer header).
Every error answer has OpenAI's shape.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import logging
import time

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from shared.protocol import ping_subject
from shared.wait_log import WaitLog

from .dashboard import DashboardRoutes
from .errors import ApiError, error_response, json_response
from .http_endpoints import GenerationEndpoint
from .tokens_endpoints import TokenEndpoints
from .lora_routes import LoRARoutes
from .bus_client import GatewayService

logger = logging.getLogger(__name__)


# Guarded like /v1 (vLLM leaves them open): they expose the served model's tokenizer.
TOKEN_ROUTES = ("/tokenize", "/detokenize")
DASHBOARD = "/dashboard"


def _is_monitoring(path: str) -> bool:
    return path == "/metrics" or path == DASHBOARD or path.startswith(DASHBOARD + "/")


def _basic_password(authorization: str) -> str | None:
    """The password of an HTTP Basic ``Authorization`` header (None if it is not one)."""
    scheme, _, encoded = authorization.partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        return base64.b64decode(encoded, validate=True).decode().partition(":")[2]
    except (binascii.Error, UnicodeDecodeError):
        return None


class ApiKeyMiddleware:
    """Pure ASGI (streams pass untouched): /v1 routes need the bearer key, and so do
    /metrics and /dashboard (they tell request counts and timings, and the fleet) unless
    ``metrics_public``; those two also take the key as an HTTP Basic password."""

    def __init__(self, app, api_key: str, metrics_public: bool) -> None:
        self.app = app
        self.api_key = api_key.encode()
        self.expected = f"Bearer {api_key}".encode()
        self.metrics_public = metrics_public

    def _guarded(self, path: str) -> bool:
        if _is_monitoring(path):
            return not self.metrics_public
        return path == "/v1" or path.startswith("/v1/") or path in TOKEN_ROUTES

    def _allowed(self, path: str, authorization: str) -> bool:
        if hmac.compare_digest(authorization.encode(), self.expected):
            return True
        password = _basic_password(authorization) if _is_monitoring(path) else None
        return password is not None and hmac.compare_digest(password.encode(), self.api_key)

    async def __call__(self, scope, receive, send) -> None:
        path = scope["path"] if scope["type"] == "http" else ""
        if path and self._guarded(path):
            if not self._allowed(path, Headers(scope=scope).get("authorization", "")):
                error = ApiError("Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                                 status=401, code="invalid_api_key")
                response = error_response(error.info)
                if path.startswith(DASHBOARD):  # a browser asks for the key
                    response.headers["WWW-Authenticate"] = 'Basic realm="natsllm", charset="UTF-8"'
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class InfoRoutes:
    """The routes that do not generate."""

    def __init__(self, gateway: GatewayService) -> None:
        self.gateway = gateway
        self.started = int(time.time())
        self.lora = LoRARoutes(gateway)
        self.wait_log = WaitLog(logger, f"gateway {gateway.gateway_id}")

    def _model_card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.started, "owned_by": "natsllm",
                "root": name, "parent": None}

    async def models(self, request: Request) -> Response:
        names = self.gateway.config.served_model_names
        cards = [self._model_card(n) for n in names] + self.lora.model_cards(self._model_card)
        return json_response({"object": "list", "data": cards})

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        adapters = {card["id"]: card for card in self.lora.model_cards(self._model_card)}
        if name in adapters:
            return json_response(adapters[name])
        if name not in self.gateway.config.served_model_names:
            return error_response(ApiError(f"The model `{name}` does not exist.", status=404, param="model",
                                           code="model_not_found").info)
        return json_response(self._model_card(name))

    async def health(self, request: Request) -> Response:
        """200 only when a request would be served: a tokenizer answers and an engine is ready."""
        tokenizer = await self.gateway.tokenizer_alive()
        ready = self.gateway.engine_stats.ready_engines(self.gateway.config.engine_ready_ttl)
        ok = tokenizer and bool(ready) and not self.gateway.closing
        if ok:
            self.wait_log.done(f"serving: a tokenizer answers, {len(ready)} engine(s) ready")
        elif not self.gateway.closing:
            missing = [] if tokenizer else [f"a tokenizer to answer on {ping_subject('tokenizer')}"]
            if not ready:
                missing.append(f"an engine to be ready ({len(self.gateway.engine_stats.current())} heard from)")
            self.wait_log.waiting(" and ".join(missing))
        body = {
            "status": "ok" if ok else "unavailable",
            "tokenizer": tokenizer,
            "engines": len(self.gateway.engine_stats.current()),
            "engines_ready": len(ready),
            "gateway_id": self.gateway.gateway_id,
        }
        return json_response(body, 200 if ok else 503)

    async def metrics(self, request: Request) -> Response:
        return Response(self.gateway.metrics.render(), media_type=CONTENT_TYPE_PLAIN_0_0_4)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return error_response(ApiError(f"{exc.detail}: {request.method} {request.url.path}",
                                   status=exc.status_code, type=kind).info)


async def _internal_error(request: Request, exc: Exception) -> Response:
    logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return error_response(ApiError(f"internal error: {exc}", status=500, type="internal_error").info)


def build_app(gateway: GatewayService) -> Starlette:
    info = InfoRoutes(gateway)
    tokens = TokenEndpoints(gateway)
    dashboard = DashboardRoutes(gateway)
    routes = [
        Route("/v1/chat/completions", GenerationEndpoint(gateway, "chat").endpoint, methods=["POST"]),
        Route("/v1/completions", GenerationEndpoint(gateway, "completion").endpoint, methods=["POST"]),
        Route("/tokenize", tokens.tokenize, methods=["POST"]),
        Route("/detokenize", tokens.detokenize, methods=["POST"]),
        Route("/v1/models", info.models, methods=["GET"]),
        Route("/v1/load_lora_adapter", info.lora.load, methods=["POST"]),
        Route("/v1/unload_lora_adapter", info.lora.unload, methods=["POST"]),
        Route("/v1/models/{model:path}", info.model, methods=["GET"]),
        Route("/health", info.health, methods=["GET"]),
        # vLLM's alias (SageMaker's probe path), GET and POST
        Route("/ping", info.health, methods=["GET", "POST"]),
        Route("/metrics", info.metrics, methods=["GET"]),
        Route(DASHBOARD, dashboard.page, methods=["GET"]),
        Route(DASHBOARD + "/", dashboard.page, methods=["GET"]),
        Route(DASHBOARD + "/events", dashboard.events, methods=["GET"]),
        Route(DASHBOARD + "/state", dashboard.state, methods=["GET"]),
        Route(DASHBOARD + "/{name}", dashboard.static, methods=["GET"]),
    ]
    api_key = gateway.config.api_key
    middleware = []
    if api_key:
        middleware.append(Middleware(ApiKeyMiddleware, api_key=api_key, metrics_public=gateway.config.metrics_public))
    return Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={HTTPException: _http_error, Exception: _internal_error},
    )
