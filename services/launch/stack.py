"""Starts a whole stack on one machine: nats-server and one process per service.

``scripts/serve`` runs it in the foreground; the end-to-end tests start the same
stack. Every service is its own OS process (``python -m services.<name>``) in its
own process group, started through a ``Supervisor``, nats-server too (or a cluster of
them, ``nats_cluster``, each node supervised like a service): from the start, a process
that dies is started again (and the counts reach the gateways' /metrics); one that keeps
dying spends its crash-loop budget and is named by ``crash_loops()``, the launcher's cue
to give up; stopping the stack, or killing the launcher, leaves nothing running. nats-server runs
with one user per service role and one for the gateway (fresh passwords per run), each
service gets its user's credentials in its environment; the gateway's user name is its
id (``GATEWAY_ID``). Extra flags go to the services that take them
(``service_flags``). Each service process has its own status file (``HEARTBEAT_FILE``
in ``status_dir``): ``progress`` reads what each is doing while the stack starts, and
``status()`` what each said last (its metrics port, among the rest).

``data_parallel_size`` engines (vLLM's ``--data-parallel-size``), each its own scheduler and
``tensor_parallel_size`` worker ranks with its own engine id; with P/D, each prefill and each
decode instance is that many engines, as a vLLM server of that role would be. With more
than one engine the schedulers publish KV cache events and the tokenizers' routers place each
request on one engine (``services/router``; ``--router-mode`` goes to the tokenizers), and
each worker gets its share of the machine's cores (``cpu_omp_threads_bind``).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from services.launch.nats_cluster import NatsCluster
from services.launch.nats_server import NatsServer, free_port
from services.launch.progress import StartupProgress
from services.launch.supervisor import CrashLoopBudget, Supervisor
from shared import healthcheck
from shared.bus import flush_in_order, publish
from shared.bus_auth import gateway_user
from shared.config import KV_CONSUMER, KV_PRODUCER, ConfigError, kv_transfer_config_json
from shared.cpu_sets import UNBOUND, check_bind, format_cpu_list, split_cores
from shared.protocol import SERVICE_RESTARTS_CHANNEL, ServiceRestarts
from services.launch.service_flags import split_service_args
from services.scheduler.config import kv_events_config_json

ROOT = Path(__file__).resolve().parents[2]
SUPERVISE_INTERVAL = 0.5  # seconds between looks for dead services
RESTARTS_REPUBLISH_INTERVAL = 10.0
PUBLISH_TIMEOUT = 2.0  # seconds the supervising thread may spend publishing restart counts
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
    # nats-servers: 1, or a cluster of this many (routes between them, nats_cluster.py).
    nats_cluster: int = 1
    # Data-parallel engines (vLLM's --data-parallel-size): this many engines where there would
    # be one (with P/D: per prefill and per decode instance).
    data_parallel_size: int = 1
    # The cores of each worker (shared/cpu_sets.py): auto splits this process's cores evenly
    # among the workers when there are several; nobind leaves each every core; else one core
    # list per worker, "|"-separated, in the order of engines() and their ranks.
    cpu_omp_threads_bind: str = "auto"
    # A process that dies more often than this is given up on (supervisor.CrashLoopBudget).
    crash_loop: CrashLoopBudget = CrashLoopBudget()

    def engines(self) -> list[tuple[str, str]]:
        """(engine id, kv_role) of each engine to start; ("", "") is the one plain engine."""
        n = self.data_parallel_size
        if not self.prefill_engines and not self.decode_engines:
            return [("", "")] if n == 1 else [(str(i), "") for i in range(n)]
        return ([(f"prefill-{i}", KV_PRODUCER) for i in range(self.prefill_engines * n)]
                + [(f"decode-{i}", KV_CONSUMER) for i in range(self.decode_engines * n)])

    @property
    def num_workers(self) -> int:
        return len(self.engines()) * self.tensor_parallel_size

    def worker_cores(self) -> list[str]:
        """Each worker's ``--cpu-omp-threads-bind`` value, in the order of engines() and ranks."""
        bind = self.cpu_omp_threads_bind.strip()
        if bind.lower() in UNBOUND:
            if bind.lower() == "nobind" or self.num_workers == 1:
                return ["nobind"] * self.num_workers
            return [format_cpu_list(c) for c in split_cores(sorted(os.sched_getaffinity(0)), self.num_workers)]
        entries = bind.split("|")
        if len(entries) != self.num_workers:
            raise ConfigError(f"cpu_omp_threads_bind {bind!r} names {len(entries)} core list(s) for "
                              f"{self.num_workers} worker(s)")
        return entries


def visible_gpus(environ=os.environ) -> list[str]:
    """The GPUs this launcher's processes may use, as CUDA_VISIBLE_DEVICES entries: that
    variable's, else ``nvidia-smi -L``'s indices (none without a driver)."""
    if environ.get("CUDA_VISIBLE_DEVICES") is not None:
        return [g for g in environ["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(line for line in listing.splitlines() if line.startswith("GPU "))]


def engine_gpus(num_engines: int, tensor_parallel_size: int, gpus: list[str] | None = None) -> list[str | None]:
    """Each engine's CUDA_VISIBLE_DEVICES: with several engines and a GPU for each of their
    ranks, engine i gets GPUs ``i * tp ..`` (its rank r then uses its r-th); otherwise None
    (every process sees every GPU, and rank r uses GPU ``r % count``, shared between engines)."""
    gpus = visible_gpus() if gpus is None else gpus
    if num_engines < 2 or len(gpus) < num_engines * tensor_parallel_size:
        return [None] * num_engines
    tp = tensor_parallel_size
    return [",".join(gpus[i * tp:(i + 1) * tp]) for i in range(num_engines)]


class Stack:
    def __init__(self, config: StackConfig) -> None:
        self.config = config
        # Raises ConfigError, before anything starts, for a flag no service takes.
        self.service_args = split_service_args(config.args)
        if (config.prefill_engines > 0) != (config.decode_engines > 0):
            raise ConfigError("P/D needs at least one prefill engine and one decode engine")
        if config.data_parallel_size < 1:
            raise ConfigError(f"data_parallel_size must be >= 1, got {config.data_parallel_size}")
        try:
            check_bind(config.cpu_omp_threads_bind)
        except ValueError as e:
            raise ConfigError(f"cpu_omp_threads_bind: {e}") from None
        self.worker_cores = config.worker_cores()
        role_flags = {"--kv-transfer-config", "--kv-role"} & {a.split("=", 1)[0] for a in config.args}
        if config.prefill_engines and role_flags:
            raise ConfigError(f"{', '.join(sorted(role_flags))}: with --prefill-engines / --decode-engines the "
                              f"launcher gives each engine its kv_role")
        if config.nats_cluster < 1:
            raise ConfigError(f"--nats-cluster must be at least 1, got {config.nats_cluster}")
        self.nats: NatsServer | NatsCluster | None = None
        self.supervisor = Supervisor(crash_loop=config.crash_loop)
        self.status_dir = tempfile.mkdtemp(prefix="natsllm-status-")
        self.progress = StartupProgress({})
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

    def start_service(self, name: str, module: str, args: list[str],
                      env: dict[str, str] | None = None) -> subprocess.Popen | None:
        role = module.removeprefix("services.")
        if role in self.config.without:
            return None
        log = os.path.join(self.config.log_dir, f"{name}.log") if self.config.log_dir is not None else None
        env = {**self._env(role), **(env or {})}
        env["HEARTBEAT_FILE"] = self.progress.status_files[name] = os.path.join(self.status_dir, f"{name}.json")
        return self.supervisor.start(name, [sys.executable, "-m", module, *args], env, str(ROOT), log)

    def status(self, name: str) -> dict:
        """What service process ``name`` last wrote to its status file ({} if nothing)."""
        path = self.progress.status_files.get(name)
        return healthcheck.read(path) if path else {}

    def restart_service(self, name: str) -> subprocess.Popen:
        """Kill a service (if running) and start it again with its first arguments."""
        self.supervisor.kill(name)
        child = self.supervisor.children[name]
        child.process.wait()
        return self.supervisor.start(name, child.argv, child.env, child.cwd, child.log_path)

    def start(self) -> None:
        cfg = self.config
        log = os.path.join(cfg.log_dir, "nats.log") if cfg.log_dir else None
        if cfg.nats_cluster > 1:
            self.nats = NatsCluster(cfg.nats_cluster, self.supervisor, log_dir=cfg.log_dir,
                                    authenticated=cfg.authenticated_bus, gateway_ids=[GATEWAY_ID])
        else:
            self.nats = NatsServer(port=cfg.nats_port, log_file=log, authenticated=cfg.authenticated_bus,
                                   gateway_ids=[GATEWAY_ID], supervisor=self.supervisor)
        model = ["--model", cfg.model] if cfg.model else []
        extra = self.service_args
        cores = iter(self.worker_cores)
        gpus = iter(engine_gpus(len(cfg.engines()), cfg.tensor_parallel_size))
        for engine_id, kv_role in cfg.engines():
            self._start_engine(engine_id, kv_role, model, [next(cores) for _ in range(cfg.tensor_parallel_size)],
                               next(gpus))
        for i in range(cfg.num_tokenizers):
            self.start_service(f"tokenizer-{i}", "services.tokenizer", [*model, *extra["tokenizer"]])
        for i in range(cfg.num_detokenizers):
            self.start_service(f"detokenizer-{i}", "services.detokenizer", [*model, *extra["detokenizer"]])
        self.start_service(
            "gateway", "services.gateway",
            [*model, "--host", cfg.host, "--port", str(cfg.port), *extra["gateway"]],
        )
        self.start_supervising()

    def _start_engine(self, engine_id: str, kv_role: str, model: list[str], cores: list[str],
                      gpus: str | None = None) -> None:
        """One engine: its worker ranks (on ``cores``, one entry per rank; on the GPUs
        ``gpus`` names, if given, as their CUDA_VISIBLE_DEVICES) and its scheduler.
        The plain engine's processes are ``worker-<rank>`` and ``scheduler``; a data-parallel
        engine's ``engine-<id>-worker-<rank>`` and ``engine-<id>-scheduler``; a P/D engine's
        ``<engine id>-worker-<rank>`` and ``<engine id>-scheduler``."""
        cfg = self.config
        extra = self.service_args
        tp = ["--tensor-parallel-size", str(cfg.tensor_parallel_size)]
        role = ["--engine-id", engine_id] if engine_id else []
        if kv_role:
            role += ["--kv-transfer-config", kv_transfer_config_json(kv_role)]
        prefix = f"{engine_id}-" if kv_role else f"engine-{engine_id}-" if engine_id else ""
        events = []
        if len(cfg.engines()) > 1 and "--kv-events-config" not in {a.split("=", 1)[0] for a in extra["scheduler"]}:
            events = ["--kv-events-config", kv_events_config_json()]  # for the routers
        # TP ranks meet in a torch.distributed rendezvous hosted by rank 0 (args may override).
        dist = []
        if cfg.tensor_parallel_size > 1:
            dist = ["--dist-init-method", f"tcp://127.0.0.1:{free_port()}"]
        for rank in range(cfg.tensor_parallel_size):
            self.start_service(f"{prefix}worker-{rank}", "services.worker",
                               [*model, *tp, *role, "--rank", str(rank), *dist, "--cpu-omp-threads-bind", cores[rank],
                                *extra["worker"]], env={"CUDA_VISIBLE_DEVICES": gpus} if gpus is not None else None)
        self.start_service(f"{prefix}scheduler", "services.scheduler",
                           [*model, *tp, *role, *events, *extra["scheduler"]])

    def wait_ready(self, timeout: float = 300.0, show=None) -> None:
        """Until /health says the gateway reaches a tokenizer and the engine is ready. A
        service that dies meanwhile is restarted as at any time; one in a crash loop is a
        start-up error. ``show(line)``: called with each service's progress."""
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if show is not None:
                for line in self.progress.changes():
                    show(line)
            looping = self.crash_loops()
            if looping:
                raise RuntimeError(f"crash loop during start-up: {'; '.join(looping.values())}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=1) as r:
                    if r.status == 200 and self.engine_ready():
                        return
            except OSError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"stack not ready after {timeout}s; not serving: {', '.join(self.progress.waiting())}")

    def engine_ready(self) -> bool:
        """The scheduler answers its health ping with ready=True once its workers are up;
        with P/D, every engine's stats say ready."""
        import asyncio

        from shared.bus import request
        from shared.protocol import ENGINE_STATS_CHANNEL, PING_CHANNEL

        engine_ids = {engine_id for engine_id, _ in self.config.engines() if engine_id}

        async def ask() -> bool:
            try:
                nc = await self._admin_connection()
            except Exception:
                return False  # the bus is down (being restarted): not ready
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

    async def _admin_connection(self):
        """A connection as the admin user that gives up at once when the bus is down (nats-py's
        default first connect retries for minutes): each node is tried once."""
        import nats

        return await nats.connect(servers=self.nats.servers, connect_timeout=1, max_reconnect_attempts=0,
                                  **self.nats.credentials("admin"))

    def dead_services(self) -> dict[str, int]:
        """Services that exited and are not running again (yet). A node of a nats cluster is
        not one: the others carry the bus while it is restarted."""
        nodes = self.nats.names if isinstance(self.nats, NatsCluster) else ()
        return {name: code for name, code in self.supervisor.dead().items() if name not in nodes}

    def crash_loops(self) -> dict[str, str]:
        """Processes given up on for dying too often, each with why (``Supervisor.crash_loops``)."""
        return self.supervisor.crash_loops()

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

        # Bounded: this thread also restarts nats-server, so a dead bus must not hold it
        # (nats-py's default first connect retries for minutes).
        async def send() -> None:
            nc = await self._admin_connection()
            try:
                await publish(nc, SERVICE_RESTARTS_CHANNEL, ServiceRestarts(counts))
                await flush_in_order(nc)
            finally:
                await nc.close()

        if not self.nats.up():
            return  # down: the next round tries again
        try:
            asyncio.run(asyncio.wait_for(send(), PUBLISH_TIMEOUT))
        except Exception as e:  # the bus may be down; the next round tries again
            logger.warning("restart counts not published: %r", e)

    def stop(self, timeout: float = 8.0) -> None:
        """Every service and nats-server, within ``timeout`` seconds plus nats-server's stop."""
        self._stopping.set()
        if self._supervising is not None:
            self._supervising.join()
        # Services first, so they drain into a live bus.
        self.supervisor.stop(timeout, spare=frozenset(self.nats.names if self.nats is not None else ()))
        if self.nats is not None:
            self.nats.stop()
        shutil.rmtree(self.status_dir, ignore_errors=True)

    def __enter__(self) -> "Stack":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
