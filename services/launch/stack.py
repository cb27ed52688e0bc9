"""Starts a whole stack on one machine: nats-server and one process per service.

``scripts/serve`` runs it in the foreground; the end-to-end tests start the same
stack. Every service is its own OS process (``python -m services.<name>``) in its
own process group, started through a ``Supervisor``: once the stack is ready, a
service that dies is started again (and the counts reach the gateways' /metrics);
stopping the stack, or killing the launcher, leaves nothing running. nats-server runs
with one user per service role and one for the gateway (fresh passwords per run), each
service gets its user's credentials in its environment; the gateway's user name is its
id (``GATEWAY_ID``). Extra flags go to the services that take them
(``service_flags``).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from services.launch.nats_server import NatsServer, free_port
from services.launch.supervisor import Supervisor
from shared.bus import flush_in_order, publish
from shared.bus_auth import gateway_user
from shared.config import KV_CONSUMER, KV_PRODUCER, ConfigError, kv_transfer_config_json
from shared.protocol import SERVICE_RESTARTS_CHANNEL, ServiceRestarts
from services.launch.service_flags import split_service_args

ROOT = Path(__file__).resolve().parents[2]
SUPERVISE_INTERVAL = 0.5  # seconds between looks for dead services
RESTARTS_REPUBLISH_INTERVAL = 10.0
GATEWAY_ID = "0"  # the one gateway's id (its NATS user is gateway-0), kept across restarts

logger = logging.getLogger(__name__)


@dataclass
class StackConfig:
    port: int = 8000
    host: str = "127.0.0.1"
    model: str = ""
    tensor_parallel_size: int = 1
    num_tokenizers: int = 1
    num_detokenizers: int = 1
    nats_port: int = 0
    # Extra flags, e.g. --num-gpu-blocks 64: each goes to every service that takes it.
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    # Services not to start (e.g. {"scheduler"}), for tests of a stack missing a part.
    without: frozenset[str] = frozenset()
    log_dir: str | None = None
    # nats-server with one user per service role and fresh passwords (shared/bus_auth.py).
    authenticated_bus: bool = True
    # P/D disaggregation: this many prefill and decode engines (each its own scheduler and
    # tensor_parallel_size worker ranks) instead of one engine; both 0: one plain engine.
    prefill_engines: int = 0
    decode_engines: int = 0

    def engines(self) -> list[tuple[str, str]]:
        """(engine id, kv_role) of each engine to start; ("", "") is the one plain engine."""
        if not self.prefill_engines and not self.decode_engines:
            return [("", "")]
        return ([(f"prefill-{i}", KV_PRODUCER) for i in range(self.prefill_engines)]
                + [(f"decode-{i}", KV_CONSUMER) for i in range(self.decode_engines)])


class Stack:
    def __init__(self, config: StackConfig) -> None:
        self.config = config
        # Raises ConfigError, before anything starts, for a flag no service takes.
        self.service_args = split_service_args(config.args)
        if (config.prefill_engines > 0) != (config.decode_engines > 0):
            raise ConfigError("P/D needs at least one prefill engine and one decode engine")
        role_flags = {"--kv-transfer-config", "--kv-role"} & {a.split("=", 1)[0] for a in config.args}
        if config.prefill_engines and role_flags:
            raise ConfigError(f"{', '.join(sorted(role_flags))}: with --prefill-engines / --decode-engines the "
                              f"launcher gives each engine its kv_role")
        self.nats: NatsServer | None = None
        self.supervisor = Supervisor()
        self._supervising: threading.Thread | None = None
        self._stopping = threading.Event()

    @property
    def base_url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    @property
    def processes(self) -> dict[str, subprocess.Popen]:
        return {name: child.process for name, child in self.supervisor.children.items()}

    def _env(self, role: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.config.env)
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        env["NATS_URL"] = self.nats.url
        env.update(self.nats.env_for(gateway_user(GATEWAY_ID) if role == "gateway" else role))
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        return env

    def start_service(self, name: str, module: str, args: list[str]) -> subprocess.Popen | None:
        role = module.removeprefix("services.")
        if role in self.config.without:
            return None
        log = os.path.join(self.config.log_dir, f"{name}.log") if self.config.log_dir is not None else None
        return self.supervisor.start(name, [sys.executable, "-m", module, *args], self._env(role), str(ROOT), log)

    def restart_service(self, name: str) -> subprocess.Popen:
        """Kill a service (if running) and start it again with its first arguments."""
        self.supervisor.kill(name)
        child = self.supervisor.children[name]
        child.process.wait()
        return self.supervisor.start(name, child.argv, child.env, child.cwd, child.log_path)

    def start(self) -> None:
        cfg = self.config
        log = os.path.join(cfg.log_dir, "nats.log") if cfg.log_dir else None
        self.nats = NatsServer(port=cfg.nats_port, log_file=log, authenticated=cfg.authenticated_bus,
                               gateway_ids=[GATEWAY_ID])
        model = ["--model", cfg.model] if cfg.model else []
        extra = self.service_args
        for engine_id, kv_role in cfg.engines():
            self._start_engine(engine_id, kv_role, model)
        for i in range(cfg.num_tokenizers):
            self.start_service(f"tokenizer-{i}", "services.tokenizer", [*model, *extra["tokenizer"]])
        for i in range(cfg.num_detokenizers):
            self.start_service(f"detokenizer-{i}", "services.detokenizer", [*model, *extra["detokenizer"]])
        self.start_service(
            "gateway", "services.gateway",
            [*model, "--host", cfg.host, "--port", str(cfg.port), *extra["gateway"]],
        )

    def _start_engine(self, engine_id: str, kv_role: str, model: list[str]) -> None:
        """One engine: its worker ranks and its scheduler. The plain engine's processes are
        ``worker-<rank>`` and ``scheduler``; a P/D engine's ``<engine id>-worker-<rank>`` and
        ``<engine id>-scheduler``."""
        cfg = self.config
        extra = self.service_args
        tp = ["--tensor-parallel-size", str(cfg.tensor_parallel_size)]
        role = ["--engine-id", engine_id, "--kv-transfer-config", kv_transfer_config_json(kv_role)] if engine_id else []
        prefix = f"{engine_id}-" if engine_id else ""
        # TP ranks meet in a torch.distributed rendezvous hosted by rank 0 (args may override).
        dist = []
        if cfg.tensor_parallel_size > 1:
            dist = ["--dist-init-method", f"tcp://127.0.0.1:{free_port()}"]
        for rank in range(cfg.tensor_parallel_size):
            self.start_service(f"{prefix}worker-{rank}", "services.worker",
                               [*model, *tp, *role, "--rank", str(rank), *dist, *extra["worker"]])
        self.start_service(f"{prefix}scheduler", "services.scheduler", [*model, *tp, *role, *extra["scheduler"]])

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Until /health says the gateway reaches a tokenizer and the engine is ready; a
        service that exits meanwhile is a start-up error. Then services that die are
        restarted (``supervise``)."""
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = self.dead_services()
            if dead:
                raise RuntimeError(f"service(s) exited during start-up: {dead}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=1) as r:
                    if r.status == 200 and self.engine_ready():
                        self.start_supervising()
                        return
            except OSError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"stack not ready after {timeout}s")

    def engine_ready(self) -> bool:
        """The scheduler answers its health ping with ready=True once its workers are up;
        with P/D, every engine's stats say ready."""
        import asyncio

        import nats

        from shared.bus import request
        from shared.protocol import ENGINE_STATS_CHANNEL, PING_CHANNEL

        engine_ids = {engine_id for engine_id, _ in self.config.engines() if engine_id}

        async def ask() -> bool:
            nc = await nats.connect(self.nats.url, **self.nats.credentials("admin"))
            try:
                if engine_ids:
                    ready: set[str] = set()
                    sub = await nc.subscribe(ENGINE_STATS_CHANNEL.subject())
                    deadline = time.monotonic() + 2.5  # stats come every second
                    while ready < engine_ids and time.monotonic() < deadline:
                        try:
                            stats = ENGINE_STATS_CHANNEL.decode((await sub.next_msg(timeout=0.5)).data)
                        except Exception:
                            continue
                        if stats.ready:
                            ready.add(stats.engine_id)
                    return ready >= engine_ids
                pong = await request(nc, PING_CHANNEL, b"", "scheduler", timeout=0.5)
                return bool(pong.info.get("ready"))
            except Exception:
                return False
            finally:
                await nc.close()

        return asyncio.run(ask())

    def dead_services(self) -> dict[str, int]:
        """Services that exited and are not running again (yet)."""
        return self.supervisor.dead()

    def start_supervising(self) -> None:
        """Restart services that die, from a thread that lives as long as the stack (the
        children's parent-death signal is tied to the thread that starts them)."""
        if self._supervising is None:
            self._supervising = threading.Thread(target=self._supervise, name="supervisor", daemon=True)
            self._supervising.start()

    def _supervise(self) -> None:
        published = 0.0
        while not self._stopping.wait(SUPERVISE_INTERVAL):
            restarted = self.supervisor.poll()
            counts = self.supervisor.restart_counts()
            now = time.monotonic()
            # Gateways show the counts in /metrics; one started later learns them within a while.
            if restarted or (any(counts.values()) and now - published > RESTARTS_REPUBLISH_INTERVAL):
                self._publish_restarts(counts)
                published = now

    def _publish_restarts(self, counts: dict[str, int]) -> None:
        import asyncio

        import nats

        async def send() -> None:
            nc = await nats.connect(self.nats.url, **self.nats.credentials("admin"))
            try:
                await publish(nc, SERVICE_RESTARTS_CHANNEL, ServiceRestarts(counts))
                await flush_in_order(nc)
            finally:
                await nc.close()

        try:
            asyncio.run(send())
        except Exception as e:  # the bus may be down; the next round tries again
            logger.warning("restart counts not published: %r", e)

    def stop(self, timeout: float = 8.0) -> None:
        """Every service and nats-server, within ``timeout`` seconds plus nats-server's stop."""
        self._stopping.set()
        if self._supervising is not None:
            self._supervising.join()
        self.supervisor.stop(timeout)
        if self.nats is not None:
            self.nats.stop()

    def __enter__(self) -> "Stack":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
