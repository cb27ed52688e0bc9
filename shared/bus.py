"""The small base every service stands on: NATS connection, handlers, lifecycle.

A service subclasses ``Service``, registers one async handler per subject in
``setup()`` (with a queue group where replicas share the work), and runs with
``run_service``. The base connects to ``NATS_URL`` (a server, or a cluster's nodes
comma-separated: it reconnects to another node when its own dies, forever, and
re-subscribes; with the role's credentials
from the environment, see ``shared/bus_auth.py``), wraps every handler in one
error boundary (an exception is logged with the subject and counted, never
kills the subscription), answers health pings on ``llm.ping.<service>``, keeps its
heartbeat file fresh while its loop runs and nats-server answers
(``shared/healthcheck.py``: a container healthcheck without bus permissions), says
what it is and does on ``llm.status.<service>`` at each heartbeat (``ServiceStatus``:
the gateways' /dashboard lists every replica), serves its Prometheus metrics on its own
port when given one (``shared/service_metrics.py``), and on SIGTERM/SIGINT drains the
connection and exits.

Messages go out through channels (``shared.protocol.Channel``: a subject bound to its
message type): ``publish``, ``request`` and ``respond`` encode with the channel's codec
and refuse a message of another type before anything is sent. ``headers`` (a request's
W3C trace context, ``shared/tracing.py``) go in the NATS message's headers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
import uuid

import nats
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError

from shared import aio, healthcheck, startup, tracing
from shared.bus_auth import connect_credentials
from shared.protocol import PING_CHANNEL, SERVICE_STATUS_CHANNEL, Channel, Pong, ServiceStatus
from shared.service_metrics import MetricsServer, MetricsServerConfig, new_registry

logger = logging.getLogger(__name__)

TASK_STOP_TIMEOUT = 5.0  # seconds close() waits for the service's cancelled tasks
DRAIN_TIMEOUT = 2.0  # seconds close() gives the NATS connection to drain


def default_nats_url() -> str:
    return os.environ.get("NATS_URL", "nats://127.0.0.1:4222")


def nats_servers(url: str) -> list[str]:
    """The servers of a ``NATS_URL``: one URL, or a cluster's nodes comma-separated (the
    client connects to one and moves to another when it goes)."""
    return [part.strip() for part in url.split(",") if part.strip()]


async def publish(nc: nats.NATS, channel: Channel, message, *parts, headers: dict[str, str] | None = None) -> None:
    """Publish ``message`` on the channel's subject for ``parts``."""
    await nc.publish(channel.subject(*parts), channel.encode(message), headers=headers)


# A request that finds no responder is asked again for a moment: on a cluster, a responder
# that is moving to another node (its own died) is not subscribed there yet.
NO_RESPONDERS_WINDOW = 1.0  # seconds
NO_RESPONDERS_PAUSE = 0.1  # seconds between the tries


async def request(nc: nats.NATS, channel: Channel, message, *parts, timeout: float,
                  no_responders_window: float = 0.0, headers: dict[str, str] | None = None):
    """Ask on the channel's subject for ``parts``; the decoded answer (nats-py's errors
    when none comes: no responders, timeout). No responder is asked again, every
    ``NO_RESPONDERS_PAUSE``, for ``no_responders_window`` seconds."""
    data = channel.encode(message)
    give_up_at = time.monotonic() + no_responders_window
    while True:
        try:
            msg = await nc.request(channel.subject(*parts), data, timeout=timeout, headers=headers)
            return channel.decode_reply(msg.data)
        except NoRespondersError:
            if time.monotonic() + NO_RESPONDERS_PAUSE > give_up_at:
                raise
            await asyncio.sleep(NO_RESPONDERS_PAUSE)


async def respond(msg: Msg, channel: Channel, reply) -> None:
    """Answer a request that came on ``channel``."""
    await msg.respond(channel.encode_reply(reply))


FLUSH_TIMEOUT = 5.0  # seconds each round trip of flush_in_order may take


async def flush_in_order(nc: nats.NATS, timeout: float = FLUSH_TIMEOUT) -> None:
    """Return once the server has processed everything ``nc`` sent before the call.

    ``nc.flush()`` alone does not promise that: nats-py queues SUB and PUB for its
    flusher task but writes the flush's PING straight to the socket, so on a busy
    loop the PONG can come back before earlier subscriptions reached the server (a
    refused SUB's error, or a message another connection publishes, then arrives
    after the flush). The first round trip lets the flusher write what was queued;
    the second PING follows it on the socket, so its PONG proves it processed.
    """
    await nc.flush(timeout)
    await nc.flush(timeout)


class Service:
    """Base of a bus service: its state, its handlers, and ``run()``."""

    name = "service"

    def __init__(self, nats_url: str | None = None, instance_id: str | None = None) -> None:
        self.nats_url = nats_url or default_nats_url()
        self.instance_id = instance_id or uuid.uuid4().hex[:12]
        self.nc: nats.NATS | None = None
        self.handler_errors = 0
        self.exit_code = 0
        self.heartbeat_file = healthcheck.heartbeat_file()
        self.heartbeat_interval = healthcheck.HEARTBEAT_INTERVAL
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        # Prometheus metrics (shared/service_metrics.py), served on their own port when
        # ``metrics_config`` is set (the service's __main__ sets it from its flags).
        self.metrics_registry = new_registry(self)
        self.metrics_config: MetricsServerConfig | None = None
        self.metrics_server: MetricsServer | None = None

    # ------------------------------------------------------------------ hooks

    async def setup(self) -> None:
        """Register handlers and start background tasks (override)."""

    async def cleanup(self) -> None:
        """Release resources before the connection drains (override)."""

    def info(self) -> dict:
        """Extra fields for health pings and the status (override)."""
        return {}

    def phase(self) -> str:
        """What the service does: "serving", or what it waits for (override)."""
        return startup.SERVING

    def metric_families(self):
        """The service's own Prometheus families, read at scrape time (override)."""
        return ()

    @property
    def metrics_port(self) -> int:
        """The port its metrics are served on (0: none)."""
        return self.metrics_server.port if self.metrics_server is not None else 0

    def status(self) -> ServiceStatus:
        return ServiceStatus(self.name, self.instance_id, self.phase(), self.info(), self.metrics_port,
                             startup.started_at(), socket.gethostname())

    # ------------------------------------------------------------------ helpers

    async def subscribe(self, subject: str, handler, queue: str = "") -> None:
        async def guarded(msg: Msg) -> None:
            try:
                await handler(msg)
            except Exception:
                self.handler_errors += 1
                logger.exception("%s %s: handler for %s failed", self.name, self.instance_id, subject)

        await self.nc.subscribe(subject, queue=queue, cb=guarded)

    async def publish(self, channel: Channel, message, *parts, headers: dict[str, str] | None = None) -> None:
        await publish(self.nc, channel, message, *parts, headers=headers)

    async def request(self, channel: Channel, message, *parts, timeout: float, no_responders_window: float = 0.0,
                      headers: dict[str, str] | None = None):
        return await request(self.nc, channel, message, *parts, timeout=timeout,
                             no_responders_window=no_responders_window, headers=headers)

    def spawn(self, coro) -> asyncio.Task:
        """Run long work off the handler (one subscription runs one callback at a time)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("%s %s: task failed", self.name, self.instance_id, exc_info=task.exception())

    def stop(self) -> None:
        self._stop.set()

    def fail(self, reason: str) -> None:
        """Stop with a non-zero exit code, so a supervisor restarts the service."""
        logger.error("%s %s: %s; exiting", self.name, self.instance_id, reason)
        self.exit_code = 1
        self._stop.set()

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        startup.phase("connecting to the bus")

        async def on_error(e: Exception) -> None:
            logger.warning("%s %s: nats error: %r", self.name, self.instance_id, e)

        self.nc = await nats.connect(
            nats_servers(self.nats_url),
            name=f"{self.name}-{self.instance_id}",
            error_cb=on_error,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            **connect_credentials(),
        )
        startup.on_the_bus()
        await self.subscribe(PING_CHANNEL.subject(self.name), self._on_ping, queue=self.name)
        if self.metrics_config is not None and self.metrics_server is None:
            self.metrics_server = MetricsServer(self.metrics_registry, self.metrics_config)
        await self.setup()
        self.spawn(self._beat())
        logger.info("%s %s: up on %s", self.name, self.instance_id, self.nats_url)

    async def _beat(self) -> None:
        """Write the heartbeat file (the service's status) after each round trip to
        nats-server: it goes stale when the loop stops or the bus connection is lost. The
        status goes on the bus too (the gateways' /dashboard)."""
        warned = False
        while True:
            try:
                # While reconnecting, nats-py's flush returns without a round trip.
                if self.nc.is_connected:
                    await self.nc.flush(timeout=self.heartbeat_interval)
                    status = self.status()
                    await publish(self.nc, SERVICE_STATUS_CHANNEL, status, self.name)
                    healthcheck.beat(self.heartbeat_file, {
                        "service": status.service, "instance_id": status.instance_id, "phase": status.phase,
                        "metrics_port": status.metrics_port, **status.info, "started_at": status.started_at,
                        "history": startup.history()})
            except OSError as e:
                if not warned:
                    logger.warning("%s %s: heartbeat file %s: %r", self.name, self.instance_id, self.heartbeat_file, e)
                    warned = True
            except (NatsError, asyncio.TimeoutError):
                pass  # no answer from the bus this time: the file ages
            await asyncio.sleep(self.heartbeat_interval)

    async def _on_ping(self, msg: Msg) -> None:
        await respond(msg, PING_CHANNEL, Pong(self.name, self.instance_id, self.info()))

    async def close(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            # A task that ignores its cancel must not keep the service from stopping.
            _, stuck = await asyncio.wait(tasks, timeout=TASK_STOP_TIMEOUT)
            for task in stuck:
                logger.warning("%s %s: task %r did not stop when cancelled", self.name, self.instance_id, task)
        await self.cleanup()
        if self.metrics_server is not None:
            self.metrics_server.close()
        if self.nc is not None and not self.nc.is_closed:
            # With the server gone, drain would wait for a reconnect that never comes.
            try:
                await asyncio.wait_for(self.nc.drain(), DRAIN_TIMEOUT)
            except Exception:
                with contextlib.suppress(Exception):
                    await self.nc.close()
        logger.info("%s %s: stopped", self.name, self.instance_id)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop)
        await self.start()
        try:
            await self._stop.wait()
        finally:
            await self.close()


def setup_logging(level: str | None = None) -> None:
    logging.basicConfig(
        level=(level or os.environ.get("LOG_LEVEL", "INFO")).upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def run_service(service: Service, metrics_config: MetricsServerConfig | None = None) -> int:
    """Run until stopped (serving its metrics per ``metrics_config``); returns the exit
    code for the process. Spans still queued are sent before it returns."""
    service.metrics_config = metrics_config
    try:
        aio.run(service.run())
    finally:
        tracing.shutdown()
    return service.exit_code
