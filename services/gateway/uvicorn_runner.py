"""The gateway process: the bus side and uvicorn in one asyncio loop.

Start: connect to NATS and subscribe (``GatewayService.start``), then serve HTTP.
Stop (SIGTERM / SIGINT, or ``stop()``): end every open request and abort it in the
engine, let uvicorn close its connections, then drain the NATS connection. The
signals are the gateway's, not uvicorn's, so one handler stops both halves.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal

import uvicorn

from .app import build_app
from .config import GatewayConfig
from .bus_client import GatewayService

STARTUP_TIMEOUT = 30.0


class ServeError(RuntimeError):
    """The HTTP side could not start (e.g. the port is taken)."""


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        # GatewayServer.run() owns SIGTERM / SIGINT.
        yield

    async def startup(self, sockets=None) -> None:
        # uvicorn calls sys.exit() when it cannot bind; that would escape the event loop.
        try:
            await super().startup(sockets)
        except SystemExit:
            raise ServeError(f"cannot serve HTTP on {self.config.host}:{self.config.port}") from None


class GatewayServer:
    def __init__(self, config: GatewayConfig, nats_url: str | None = None) -> None:
        self.config = config
        self.gateway = GatewayService(config, nats_url)
        self.app = build_app(self.gateway)
        self.server = _Server(
            uvicorn.Config(
                self.app,
                host=config.host,
                port=config.port,
                lifespan="off",
                log_config=None,
                access_log=config.access_log,
                timeout_graceful_shutdown=config.shutdown_timeout,
            )
        )
        self._serving: asyncio.Task | None = None

    @property
    def port(self) -> int:
        """The bound port (useful with port 0)."""
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def base_url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    async def start(self) -> None:
        await self.gateway.start()
        self._serving = asyncio.create_task(self.server.serve())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + STARTUP_TIMEOUT
        while not self.server.started:
            if self._serving.done() or loop.time() > deadline:
                await self.gateway.close()
                if self._serving.done():
                    self._serving.result()
                raise ServeError(f"the HTTP server did not start on {self.config.host}:{self.config.port}")
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        await self.gateway.shutdown_requests()
        self.server.should_exit = True
        if self._serving is not None:
            await self._serving
        await self.gateway.close()

    async def run(self) -> None:
        """Serve until SIGTERM or SIGINT (which also end a start still waiting for NATS)."""
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        stopping = asyncio.ensure_future(stop.wait())
        starting = asyncio.ensure_future(self.start())
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
            await self.gateway.close()
            return
        starting.result()
        await asyncio.wait({stopping, self._serving}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        await self.stop()

    async def __aenter__(self) -> "GatewayServer":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()
