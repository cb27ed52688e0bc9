"""Starts a whole stack on one machine: nats-server and one process per service.

``scripts/serve`` runs it in the foreground; the end-to-end tests start the same
stack. Every service is its own OS process (``python -m services.<name>``) in its
own process group, so stopping the stack leaves nothing running. Extra flags go to
the services that take them (``service_flags``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from services.launch.nats_server import NatsServer, free_port
from services.launch.service_flags import split_service_args

ROOT = Path(__file__).resolve().parents[2]


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


class Stack:
    def __init__(self, config: StackConfig) -> None:
        self.config = config
        # Raises ConfigError, before anything starts, for a flag no service takes.
        self.service_args = split_service_args(config.args)
        self.nats: NatsServer | None = None
        self.processes: dict[str, subprocess.Popen] = {}
        self.commands: dict[str, tuple[str, list[str]]] = {}

    @property
    def base_url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.config.env)
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        env["NATS_URL"] = self.nats.url
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        return env

    def start_service(self, name: str, module: str, args: list[str]) -> subprocess.Popen | None:
        if module.removeprefix("services.") in self.config.without:
            return None
        # Without a log folder the services log to this terminal.
        out = None
        if self.config.log_dir is not None:
            out = open(os.path.join(self.config.log_dir, f"{name}.log"), "ab")
        process = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            cwd=ROOT,
            env=self._env(),
            stdout=out,
            stderr=subprocess.STDOUT if out is not None else None,
            start_new_session=True,
        )
        self.processes[name] = process
        self.commands[name] = (module, args)
        return process

    def restart_service(self, name: str) -> subprocess.Popen:
        """Start a service again with the arguments it was first started with."""
        process = self.processes.get(name)
        if process is not None and process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        module, args = self.commands[name]
        return self.start_service(name, module, args)

    def start(self) -> None:
        cfg = self.config
        log = os.path.join(cfg.log_dir, "nats.log") if cfg.log_dir else None
        self.nats = NatsServer(port=cfg.nats_port, log_file=log)
        model = ["--model", cfg.model] if cfg.model else []
        tp = ["--tensor-parallel-size", str(cfg.tensor_parallel_size)]
        # TP ranks meet in a torch.distributed rendezvous hosted by rank 0 (args may override).
        dist = []
        if cfg.tensor_parallel_size > 1:
            dist = ["--dist-init-method", f"tcp://127.0.0.1:{free_port()}"]
        extra = self.service_args
        for rank in range(cfg.tensor_parallel_size):
            self.start_service(
                f"worker-{rank}", "services.worker", [*model, *tp, "--rank", str(rank), *dist, *extra["worker"]]
            )
        self.start_service("scheduler", "services.scheduler", [*model, *tp, *extra["scheduler"]])
        for i in range(cfg.num_tokenizers):
            self.start_service(f"tokenizer-{i}", "services.tokenizer", [*model, *extra["tokenizer"]])
        for i in range(cfg.num_detokenizers):
            self.start_service(f"detokenizer-{i}", "services.detokenizer", [*model, *extra["detokenizer"]])
        self.start_service(
            "gateway", "services.gateway",
            [*model, "--host", cfg.host, "--port", str(cfg.port), *extra["gateway"]],
        )

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Until /health says the gateway reaches a tokenizer and the engine is ready."""
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = self.dead_services()
            if dead:
                raise RuntimeError(f"service(s) exited during start-up: {dead}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=1) as r:
                    if r.status == 200 and self.engine_ready():
                        return
            except OSError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"stack not ready after {timeout}s")

    def engine_ready(self) -> bool:
        """The scheduler answers its health ping with ready=True once its workers are up."""
        import asyncio

        import nats

        from shared.protocol import PONG, ping_subject

        async def ask() -> bool:
            nc = await nats.connect(self.nats.url)
            try:
                reply = await nc.request(ping_subject("scheduler"), b"", timeout=0.5)
                return bool(PONG.decode(reply.data).info.get("ready"))
            except Exception:
                return False
            finally:
                await nc.close()

        return asyncio.run(ask())

    def dead_services(self) -> dict[str, int]:
        return {n: p.returncode for n, p in self.processes.items() if p.poll() is not None}

    def stop(self, timeout: float = 10.0) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for process in self.processes.values():
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        if self.nats is not None:
            self.nats.stop()

    def __enter__(self) -> "Stack":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
