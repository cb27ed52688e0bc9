"""`docker compose up` for real on this machine, then scaled and broken (scripts/compose-check).

    scripts/compose-check [--keep-engine]

Starts a Docker engine if none answers (as root: ``dockerd --bridge=none
--iptables=false``), makes the base images when none can be pulled (scripts/docker-base,
asked not to try a registry), lends the build what this host's pip uses (its local CPU
torch wheel and CA bundle, into docker/local/), and runs docker-compose.yml with
docker/compose.host.yml (every build and container on the host's network, every service
on a loopback port) as its own compose project, with its own env file (.env is not read
or written). Then, one line per step, each with its seconds:

  no-env     compose without the passwords refuses, naming scripts/bus-secrets
  build      the images (natsllm, nats, loadbalancer) and their sizes
  lb-follow  nginx follows a gateway that comes back at another address (a Docker network's
             case, checked in a throwaway container)
  models     the default model copied into the models volume, served from there (MODEL)
  up         every container healthy, on the host's network, listening on loopback only;
             what the logs said each service waited for
  streams    16 chat streams at once through the load balancer, and the gateway of each
  scale      under a steady load of 16 streams: tokenizers to 3, detokenizers to 2, and
             every replica shows requests it served (its status file, shared/healthcheck.py)
  kill-*     a worker container and a tokenizer container killed under that load (SIGKILL
             to the container's process, as the OOM killer does: `docker kill` would turn
             the restart policy off, Docker's documented behaviour); the policy restarts
             them and each restarted process serves requests
  load       every request of the load completed, none failed
  pd         the pd profile alone (engine 0 scaled to 0): 16 streams, each prompt's KV
             pulled by the decode engine (/metrics), prefill and decode workers both ran
  down       nothing of the project left: no container, network or volume

Exits non-zero at the first failure, after printing the last log lines of the containers
that are not healthy and bringing the stack down. It uses the standard library only.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT = "natsllm-check"
COMPOSE_FILES = ("docker-compose.yml", "docker/compose.host.yml")
# docker/compose.host.yml's ports: the load balancer, the gateways, the nats-server nodes,
# their monitors and their routes.
LB_PORT = 18000
HOST_PORTS = (LB_PORT, 18001, 18002, 14222, 14223, 14224, 18222, 18223, 18224, 16222, 16223, 16224)
STREAMS = 16
MAX_TOKENS = 24
HEALTHY_TIMEOUT = 900  # seconds for a stack to become healthy (model loads, first kernel builds)
RECOVERY_TIMEOUT = 300  # seconds for a killed container to serve again
STATS_WAIT_S = 10  # seconds for the engines' counters in /metrics to catch up (stats come once a second)
REQUEST_TIMEOUT = 300  # seconds one streamed request may take (it may wait for a restart)
LOCAL = ROOT / "docker" / "local"  # what this host lends the build (Dockerfile)
# In order; each is Check.<name>_step.
STEPS = ("engine", "ports", "no-env", "secrets", "base", "lend", "build", "lb-follow", "models", "up", "streams",
         "scale", "kill-worker", "kill-tokenizer", "load", "pd", "down")


class CheckFailed(Exception):
    pass


def run(*args: str, check: bool = True, timeout: float = 1800, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a command in the checkout, its output (stderr too) captured; a failure raises CheckFailed."""
    result = subprocess.run(args, cwd=ROOT, text=True, timeout=timeout, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    if check and result.returncode != 0:
        tail = "\n".join((result.stdout or "").splitlines()[-25:])
        raise CheckFailed(f"`{' '.join(args)}` exited {result.returncode}:\n{tail}")
    return result


def wait_until(predicate, timeout: float, what: str, interval: float = 2.0):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise CheckFailed(f"no {what} within {timeout:g}s")
        time.sleep(interval)


# --------------------------------------------------------------------------- the engine


class Engine:
    """The Docker engine: the one running, or a dockerd this check starts (and stops)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.process: subprocess.Popen | None = None

    def answers(self) -> bool:
        return run("docker", "info", check=False, timeout=60).returncode == 0

    def ensure(self) -> str:
        if self.answers():
            version = run("docker", "version", "-f", "{{.Server.Version}}").stdout.strip()
            return f"Docker {version} already running"
        if os.geteuid() != 0:
            raise CheckFailed("no Docker engine answers, and starting one (dockerd) needs root")
        if shutil.which("dockerd") is None:
            raise CheckFailed("no Docker engine answers and no dockerd is installed (apt-get install docker.io)")
        log = open(self.workdir / "dockerd.log", "w")
        # No default bridge and no iptables rules: containers here use the host's network.
        self.process = subprocess.Popen(["dockerd", "--bridge=none", "--iptables=false"], stdout=log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        wait_until(self.answers, 60, "answer from the dockerd just started", interval=1)
        version = run("docker", "version", "-f", "{{.Server.Version}}").stdout.strip()
        return f"started dockerd {version} (pid {self.process.pid}; --bridge=none --iptables=false)"

    def stop(self) -> str:
        if self.process is None:
            return ""
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
        return f"stopped the dockerd this check started (pid {self.process.pid})"


# --------------------------------------------------------------------------- compose


class Compose:
    """`docker compose` (v2) if the client has it, else `docker-compose` (v1), on this
    project's files, name and env file."""

    def __init__(self, env_file: Path) -> None:
        if run("docker", "compose", "version", check=False, timeout=60).returncode == 0:
            self.command = ["docker", "compose"]
        elif shutil.which("docker-compose"):
            self.command = ["docker-compose"]
        else:
            raise CheckFailed("neither `docker compose` nor `docker-compose` is installed")
        self.version = run(*self.command, "version", "--short", timeout=60).stdout.strip()
        self.env_file = env_file

    def args(self, env_file: Path | None = None) -> list[str]:
        files = [a for f in COMPOSE_FILES for a in ("-f", f)]
        return [*self.command, "-p", PROJECT, "--env-file", str(env_file or self.env_file), *files]

    def __call__(self, *args: str, **kwargs) -> subprocess.CompletedProcess:
        return run(*self.args(), *args, **kwargs)

    def containers(self, service: str | None = None, all_states: bool = False) -> list[str]:
        labels = [f"label=com.docker.compose.project={PROJECT}"]
        if service:
            labels.append(f"label=com.docker.compose.service={service}")
        filters = [a for label in labels for a in ("--filter", label)]
        names = run("docker", "ps", *(["-a"] if all_states else []), *filters, "--format", "{{.Names}}").stdout
        return sorted(names.split())


def inspect(container: str, template: str) -> str:
    return run("docker", "inspect", "-f", template, container, check=False).stdout.strip()


def health(container: str) -> str:
    return inspect(container, "{{if .State.Health}}{{.State.Health.Status}}{{else}}{{.State.Status}}{{end}}")


def service_of(container: str) -> str:
    return inspect(container, '{{index .Config.Labels "com.docker.compose.service"}}')


def status(container: str) -> dict:
    """What the service in the container last said of itself (shared/healthcheck.py), {} if nothing yet."""
    result = run("docker", "exec", container, "python", "-m", "shared.healthcheck", "--show", check=False)
    try:
        return json.loads(result.stdout.strip().splitlines()[0])
    except (IndexError, ValueError):
        return {}


def all_healthy(compose: Compose) -> list[str] | None:
    containers = compose.containers(all_states=True)
    if containers and all(health(c) == "healthy" for c in containers):
        return containers
    return None


def container_pids(container: str) -> set[int]:
    lines = run("docker", "top", container, check=False).stdout.splitlines()
    if not lines:
        return set()
    column = lines[0].split().index("PID")
    return {int(line.split()[column]) for line in lines[1:]}


def listeners(pids: set[int]) -> dict[str, str]:
    """The TCP addresses these processes listen on, each with its program's name."""
    found = {}
    for line in run("ss", "-ltnpH").stdout.splitlines():
        fields = line.split()
        for program, pid in re.findall(r'\("([^"]+)",pid=(\d+)', line):
            if int(pid) in pids:
                found[fields[3]] = program
    return found


def kernel_libraries(container: str) -> tuple[int, int]:
    """The C kernel libraries in the container's kernel cache (the kernel-cache volume),
    and how many of them are older than the container (built by another)."""
    started = inspect(container, "{{.State.StartedAt}}")
    started_at = datetime.fromisoformat(re.sub(r"(\.\d{6})\d*", r"\1", started).replace("Z", "+00:00"))
    out = run("docker", "exec", container, "sh", "-c", 'stat -c %Y "$NATSLLM_KERNEL_CACHE"/*.so', check=False)
    mtimes = [int(x) for x in out.stdout.split() if x.isdigit()]
    return len(mtimes), sum(m < started_at.timestamp() for m in mtimes)


# --------------------------------------------------------------------------- HTTP


@dataclass
class StreamResult:
    ok: bool
    tokens: int = 0
    text: str = ""
    error: str = ""
    seconds: float = 0.0


def model_name() -> str:
    conn = http.client.HTTPConnection("127.0.0.1", LB_PORT, timeout=30)
    conn.request("GET", "/v1/models")
    body = json.loads(conn.getresponse().read())
    return body["data"][0]["id"]


def stream_chat(model: str, index: int) -> StreamResult:
    """One streamed chat completion through the load balancer, checked whole."""
    start = time.monotonic()
    body = json.dumps({
        "model": model, "stream": True, "max_tokens": MAX_TOKENS, "temperature": 0,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": f"Request {index}: name a color and a fruit."}],
    })
    try:
        conn = http.client.HTTPConnection("127.0.0.1", LB_PORT, timeout=REQUEST_TIMEOUT)
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            return StreamResult(False, error=f"HTTP {response.status}: {response.read()[:300]!r}")
        text, finish, tokens, done = [], None, 0, False
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                return StreamResult(False, error=f"error event: {event['error']}")
            for choice in event.get("choices", []):
                text.append(choice.get("delta", {}).get("content") or "")
                finish = choice.get("finish_reason") or finish
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
        conn.close()
        seconds = time.monotonic() - start
        if not done or finish not in ("stop", "length") or tokens < 1 or not "".join(text):
            return StreamResult(False, error=f"incomplete stream: done={done} finish={finish} tokens={tokens}")
        return StreamResult(True, tokens, "".join(text), seconds=seconds)
    except (OSError, http.client.HTTPException, ValueError) as e:
        return StreamResult(False, error=f"{type(e).__name__}: {e}", seconds=time.monotonic() - start)


def streams_at_once(model: str, count: int) -> list[StreamResult]:
    results: list[StreamResult | None] = [None] * count

    def one(i: int) -> None:
        results[i] = stream_chat(model, i)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(REQUEST_TIMEOUT + 30)
    return [r or StreamResult(False, error="no answer") for r in results]


@dataclass
class Load:
    """`STREAMS` clients, each streaming one request after another until stopped."""

    model: str
    completed: int = 0
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for client in range(STREAMS):
            thread = threading.Thread(target=self._client, args=(client,), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _client(self, client: int) -> None:
        n = 0
        while not self._stop.is_set():
            result = stream_chat(self.model, 1000 * (client + 1) + n)
            n += 1
            with self._lock:
                if result.ok:
                    self.completed += 1
                else:
                    self.failures.append(result.error)

    def stop(self, wait: bool = True) -> None:
        """No new requests; with ``wait``, until the ones in flight ended."""
        self._stop.set()
        for thread in self._threads if wait else []:
            thread.join(REQUEST_TIMEOUT + 30)

    def completed_after(self, count: int, more: int, timeout: float) -> int:
        wait_until(lambda: self.completed >= count + more or self.failures, timeout,
                   f"{more} more completed requests")
        if self.failures:
            raise CheckFailed(f"a request failed under load: {self.failures[0]}")
        return self.completed


def metric(name: str) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", LB_PORT, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    values = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    if not values:
        raise CheckFailed(f"/metrics has no {name}")
    return sum(values)


# --------------------------------------------------------------------------- the steps


class Check:
    def __init__(self, keep_engine: bool) -> None:
        self.started = time.monotonic()
        self.workdir = Path(tempfile.mkdtemp(prefix="natsllm-compose-check."))
        self.env_file = self.workdir / "env"
        self.engine = Engine(self.workdir)
        self.keep_engine = keep_engine
        self.compose: Compose | None = None
        self.lent: list[Path] = []  # files this check put in docker/local/
        self.load: Load | None = None
        self.model_path = ""

    def step(self, name: str, action) -> None:
        start = time.monotonic()
        try:
            detail = action()
        except CheckFailed as e:
            print(f"{name:<15} FAILED after {time.monotonic() - start:.1f}s: {e}", flush=True)
            raise
        print(f"{name:<15} {time.monotonic() - start:6.1f}s  {detail}", flush=True)

    # ---- preparation

    def engine_step(self) -> str:
        detail = self.engine.ensure()
        self.compose = Compose(self.env_file)
        return f"{detail}; compose: {' '.join(self.compose.command)} {self.compose.version}"

    def ports_step(self) -> str:
        taken = []
        for port in HOST_PORTS:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    taken.append(port)
        if taken:
            raise CheckFailed(f"loopback ports {taken} are taken (docker/compose.host.yml needs them)")
        return f"loopback ports {', '.join(map(str, HOST_PORTS))} are free"

    def no_env_step(self) -> str:
        empty = self.workdir / "empty.env"
        empty.write_text("")
        env = {k: v for k, v in os.environ.items() if not k.startswith("NATS_PASSWORD_")}
        result = run(*self.compose.args(empty), "config", check=False, env=env)
        if result.returncode == 0 or "scripts/bus-secrets" not in result.stdout:
            raise CheckFailed(f"compose without passwords did not refuse naming scripts/bus-secrets:\n{result.stdout}")
        said = next(line for line in result.stdout.splitlines() if "scripts/bus-secrets" in line).strip()
        return f"refused: ...{said[said.rfind(' in service') if ' in service' in said else -80:]}"

    def secrets_step(self) -> str:
        said = run("scripts/bus-secrets", str(self.env_file)).stdout.strip()
        return said.replace(str(self.env_file), "the check's env file")

    def base_step(self) -> str:
        out = run("scripts/docker-base", "--no-pull", timeout=3600).stdout
        lines = [line for line in out.splitlines() if re.match(r"^(PYTHON|DEBIAN)_IMAGE=", line)]
        with open(self.env_file, "a") as f:
            f.writelines(line + "\n" for line in lines)
        said = [line.removeprefix("docker-base: ") for line in out.splitlines() if line.startswith("docker-base:")]
        return "; ".join(said + lines)

    def lend_step(self) -> str:
        lines = self.lend_build_inputs()
        with open(self.env_file, "a") as f:
            f.writelines(line + "\n" for line in lines)
        lent = ", ".join(str(p.relative_to(ROOT)) for p in self.lent) or "nothing"
        return f"lent to the build: {lent}; " + ("; ".join(lines) or "TORCH_INDEX_URL left to the Dockerfile")

    def lend_build_inputs(self) -> list[str]:
        """This host's pip's CPU torch wheel (found locally, no index asked) and CA bundle,
        for the build's pip; the env lines that go with them."""
        pin = re.search(r'"torch==([^"]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
        wheels = LOCAL / "wheels"
        before = set(wheels.glob("*.whl")) if wheels.exists() else set()
        found = run(sys.executable, "-m", "pip", "download", "--no-deps", "--no-index", "--dest", str(wheels),
                    f"torch=={pin}", check=False, timeout=600)
        env_lines = []
        if found.returncode == 0:
            self.lent += sorted(set(wheels.glob("*.whl")) - before)
            # The local wheel (a +cpu version sorts above PyPI's) and PyPI: no other index.
            env_lines.append("TORCH_INDEX_URL=https://pypi.org/simple")
        cert = os.environ.get("PIP_CERT") or self.pip_config("cert")
        if cert and Path(cert).is_file() and not (LOCAL / "pip-cert.pem").exists():
            shutil.copyfile(cert, LOCAL / "pip-cert.pem")
            self.lent.append(LOCAL / "pip-cert.pem")
        return env_lines

    @staticmethod
    def pip_config(key: str) -> str:
        listing = run(sys.executable, "-m", "pip", "config", "list", check=False, timeout=60).stdout
        match = re.search(rf"^\S*\.{key}='([^']*)'", listing, re.M)
        return match.group(1) if match else ""

    def build_step(self) -> str:
        self.compose("--profile", "pd", "build", timeout=3600)
        sizes = []
        for image in ("natsllm", "natsllm-nats", "natsllm-loadbalancer"):
            size = int(run("docker", "image", "inspect", "-f", "{{.Size}}", f"{image}:latest").stdout.strip())
            sizes.append(f"{image} {size / 1e6:.0f} MB")
        users = {image: run("docker", "image", "inspect", "-f", "{{.Config.User}}", f"{image}:latest").stdout.strip()
                 for image in ("natsllm", "natsllm-nats", "natsllm-loadbalancer")}
        if any(user in ("", "root", "0") for user in users.values()):
            raise CheckFailed(f"an image runs as root: {users}")
        return ", ".join(sizes) + f"; users {', '.join(users.values())}"

    def lb_follow_step(self) -> str:
        """On a Docker network a restarted gateway can come back at another address;
        docker/nginx/run must move nginx there. Checked in a throwaway load balancer with
        no network, whose gateway name changes address in its /etc/hosts."""
        name = f"{PROJECT}-lb-follow"
        run("docker", "run", "-d", "--rm", "--name", name, "--network", "none", "--add-host", "gw:127.0.0.2",
            "-e", "LISTEN=127.0.0.1:8000", "-e", "GATEWAYS=gw:8001", "natsllm-loadbalancer:latest")
        try:
            def proxied_to(address: str) -> bool:
                run("docker", "exec", name, "wget", "-q", "-O", "/dev/null", "http://127.0.0.1:8000/ping", check=False)
                return f'upstream: "http://{address}:8001/ping"' in run("docker", "logs", name).stdout

            wait_until(lambda: proxied_to("127.0.0.2"), 30, "request proxied to the gateway's first address", 1)
            # /etc/hosts is a file mounted into the container: rewritten in place.
            run("docker", "exec", "-u", "root", name, "sh", "-c",
                "sed 's/^127.0.0.2\tgw$/127.0.0.3\tgw/' /etc/hosts > /tmp/hosts && cat /tmp/hosts > /etc/hosts")
            wait_until(lambda: proxied_to("127.0.0.3"), 30, "request proxied to the gateway's new address", 1)
            said = [line for line in run("docker", "logs", name).stdout.splitlines() if line.startswith("loadbalancer:")]
        finally:
            run("docker", "rm", "-f", name, check=False)
        return "nginx followed a gateway to its new address (docker/nginx/run): " + " / ".join(said)

    # ---- the stack

    def models_step(self) -> str:
        """The models volume, made by compose, holding the model the stack serves (MODEL)."""
        self.compose("up", "--no-start", timeout=600)
        volume = run("docker", "volume", "ls", "-q", "--filter", f"label=com.docker.compose.project={PROJECT}",
                     "--filter", "label=com.docker.compose.volume=models").stdout.split()
        if len(volume) != 1:
            raise CheckFailed(f"compose made no single models volume: {volume}")
        copy = 'cp "$(python -c "from shared.model_config import default_model_path as p; print(p())")" /models/'
        run("docker", "run", "--rm", "--network", "none", "-v", f"{volume[0]}:/models", "natsllm:latest",
            "sh", "-c", copy + " && ls /models")
        name = run("docker", "run", "--rm", "--network", "none", "-v", f"{volume[0]}:/models:ro", "natsllm:latest",
                   "ls", "/models").stdout.split()[0]
        self.model_path = f"/models/{name}"
        with open(self.env_file, "a") as f:
            f.write(f"MODEL={self.model_path}\n")
        return f"copied the image's default model into volume {volume[0]}; MODEL={self.model_path}"

    def up_step(self) -> str:
        self.compose("up", "-d", timeout=HEALTHY_TIMEOUT)
        containers = wait_until(lambda: all_healthy(self.compose), HEALTHY_TIMEOUT, "healthy stack")
        modes = {c: inspect(c, "{{.HostConfig.NetworkMode}}") for c in containers}
        if set(modes.values()) != {"host"}:
            raise CheckFailed(f"containers off the host's network: {modes}")
        pids = set().union(*(container_pids(c) for c in containers))
        listening = listeners(pids)
        outside = [a for a in listening if not (a.startswith("127.") or a.startswith("[::1]"))]
        if outside or not listening:
            raise CheckFailed(f"the stack listens beyond loopback: {listening}")
        logs = self.compose("logs", "--no-color", timeout=120).stdout
        waits, ends = {}, {}
        for line in logs.splitlines():
            match = re.match(r"^(\S+?)[-_]\d+\s+\| .* INFO \S+: (.*: waiting for .*) \(0s so far\)$", line)
            if match:
                waits.setdefault(match.group(1), match.group(2))
            match = re.match(r"^(\S+?)[-_]\d+\s+\| .* INFO \S+: .*: (.* after waiting \S+)$", line)
            if match:
                ends.setdefault(match.group(1), match.group(2))
        if not waits or set(ends) != set(waits):
            raise CheckFailed(f"the logs do not say what each service waited for and when it stopped: {waits} {ends}")
        loaded = re.search(r"model (\S+) loaded", logs)
        if not loaded or loaded.group(1) != self.model_path:
            raise CheckFailed(f"the worker did not load {self.model_path}: {loaded and loaded.group(0)}")
        said = "; ".join(f"[{service}] {line} -> {ends[service]}" for service, line in sorted(waits.items()))
        sockets = ", ".join(f"{a} {p}" for a, p in sorted(listening.items()))
        return (f"{len(containers)} containers healthy, all on the host's network; listening only on loopback: "
                f"{sockets}; the worker loaded {loaded.group(1)}. Logged waits: {said}")

    def streams_step(self) -> str:
        self.model = model_name()
        since = str(int(time.time()) - 1)
        results = streams_at_once(self.model, STREAMS)
        failed = [r.error for r in results if not r.ok]
        if failed:
            raise CheckFailed(f"{len(failed)} of {STREAMS} streams failed: {failed[0]}")
        lb = self.compose.containers("loadbalancer")[0]
        log = run("docker", "logs", "--since", since, lb).stdout
        gateways = {}
        for match in re.finditer(r'"POST /v1/chat/completions[^"]*" 200 .*?gateway=(\S+)', log):
            gateways[match.group(1)] = gateways.get(match.group(1), 0) + 1
        if sum(gateways.values()) != STREAMS or len(gateways) < 2:
            raise CheckFailed(f"the load balancer's log shows {gateways} for {STREAMS} streams")
        tokens = sum(r.tokens for r in results)
        slowest = max(r.seconds for r in results)
        by_gateway = ", ".join(f"{g} x{n}" for g, n in sorted(gateways.items()))
        return (f"{STREAMS}/{STREAMS} complete ({tokens} tokens, slowest {slowest:.1f}s); "
                f"nginx sent them to gateways {by_gateway}; e.g. {results[0].text[:60]!r}")

    def scale_step(self) -> str:
        self.load = Load(self.model)
        self.load.start()
        self.compose("up", "-d", "--no-recreate", *self.scale_flags(), timeout=HEALTHY_TIMEOUT)
        wait_until(lambda: all_healthy(self.compose), HEALTHY_TIMEOUT, "healthy scaled stack")
        replicas = {"tokenizer": (3, "num_requests"), "detokenizer": (2, "num_outputs")}
        said = []
        for service, (count, counter) in replicas.items():
            containers = self.compose.containers(service)
            if len(containers) != count:
                raise CheckFailed(f"{len(containers)} {service} containers, not {count}")
            served = wait_until(lambda: self.all_served(containers, counter), 180,
                                f"work done by every {service} replica")
            said.append(f"{service}s " + ", ".join(f"{c}: {counter}={n}" for c, n in served.items()))
        return f"under load ({self.load.completed} requests done so far): " + "; ".join(said)

    @staticmethod
    def scale_flags() -> list[str]:
        return ["--scale", "tokenizer=3", "--scale", "detokenizer=2"]

    def all_served(self, containers: list[str], counter: str) -> dict[str, int] | None:
        if self.load.failures:
            raise CheckFailed(f"a request failed under load: {self.load.failures[0]}")
        counts = {c: status(c).get(counter, 0) for c in containers}
        return counts if all(counts.values()) else None

    def kill_step(self, service: str, counter: str) -> str:
        container = self.compose.containers(service)[0]
        restarts = int(inspect(container, "{{.RestartCount}}"))
        before = status(container).get("instance_id")
        pid = int(inspect(container, "{{.State.Pid}}"))
        done = self.load.completed
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        wait_until(lambda: int(inspect(container, "{{.RestartCount}}")) > restarts, 60, f"restart of {container}",
                   interval=0.5)
        restarted = time.monotonic() - killed

        def serving() -> dict | None:
            now = status(container)
            fresh = now.get("instance_id") not in (None, before) and now.get(counter, 0) > 0
            return now if fresh and health(container) == "healthy" else None

        now = wait_until(serving, RECOVERY_TIMEOUT, f"{container} serving again")
        recovered = time.monotonic() - killed
        total = self.load.completed_after(done, STREAMS, RECOVERY_TIMEOUT)
        return (f"{container} (pid {pid}) SIGKILLed under load; the restart policy restarted it in "
                f"{restarted:.1f}s (RestartCount {restarts} -> {inspect(container, '{{.RestartCount}}')}); "
                f"healthy and serving in {recovered:.1f}s as instance {now['instance_id']} "
                f"({counter}={now[counter]}); {total - done} requests completed since the kill, none failed")

    def kill_worker_step(self) -> str:
        return self.kill_step("worker", "num_sampled_tokens")

    def kill_tokenizer_step(self) -> str:
        return self.kill_step("tokenizer", "num_requests")

    def load_step(self) -> str:
        self.load.stop()
        if self.load.failures:
            raise CheckFailed(f"{len(self.load.failures)} request(s) failed: {self.load.failures[:3]}")
        return f"{self.load.completed} requests streamed under scaling and kills, 0 failed"

    def pd_step(self) -> str:
        self.compose("--profile", "pd", "up", "-d", "--no-recreate", *self.scale_flags(),
                     "--scale", "scheduler=0", "--scale", "worker=0", timeout=HEALTHY_TIMEOUT)
        containers = wait_until(lambda: all_healthy(self.compose), HEALTHY_TIMEOUT, "healthy pd stack")
        if self.compose.containers("worker") or self.compose.containers("scheduler"):
            raise CheckFailed("engine 0 still runs beside the pd engines")
        # The gateways route only once the prefill engine's stats say it is ready.
        wait_until(lambda: streams_at_once(self.model, 1)[0].ok, 120, "a first P/D request served")
        # The engines' counters reach /metrics with their stats (once a second): read them
        # once they count the requests just served, or after STATS_WAIT_S.
        counter = "natsllm:kv_transfer_requests_total"
        before = wait_until(lambda: metric(counter), STATS_WAIT_S, "KV transfer of the first P/D request",
                            interval=0.5)
        results = streams_at_once(self.model, STREAMS)
        failed = [r.error for r in results if not r.ok]
        if failed:
            raise CheckFailed(f"{len(failed)} of {STREAMS} P/D streams failed: {failed[0]}")
        deadline = time.monotonic() + STATS_WAIT_S
        while (transfers := metric(counter) - before) < STREAMS and time.monotonic() < deadline:
            time.sleep(0.5)
        failures = metric("natsllm:kv_transfer_failures_total")
        if transfers < STREAMS or failures:
            raise CheckFailed(f"{transfers:g} KV transfers and {failures:g} failures for {STREAMS} streams")
        workers = {s: status(self.compose.containers(s)[0]).get("num_sampled_tokens", 0)
                   for s in ("worker-prefill", "worker-decode")}
        if not all(workers.values()):
            raise CheckFailed(f"a P/D worker sampled nothing: {workers}")
        libraries, reused = kernel_libraries(self.compose.containers("worker-prefill")[0])
        if not libraries or reused != libraries:
            raise CheckFailed(f"worker-prefill's kernel cache: {libraries} libraries, {reused} built before it")
        return (f"{len(containers)} containers healthy, engine 0 scaled to 0; {STREAMS}/{STREAMS} streams complete; "
                f"/metrics: {transfers:g} prompts' KV pulled by the decode engine, {failures:g} failures; "
                f"tokens sampled: {', '.join(f'{s} {n}' for s, n in workers.items())}; worker-prefill found all "
                f"{libraries} C kernel libraries already built in the kernel-cache volume")

    def down_step(self) -> str:
        self.compose("--profile", "pd", "down", "-v", "--remove-orphans", timeout=600)
        left = {}
        for kind in ("container", "network", "volume"):
            for found in (f"label=com.docker.compose.project={PROJECT}", f"name={PROJECT}"):
                listed = run("docker", kind, "ls", *(["-a"] if kind == "container" else []), "-q", "--filter", found)
                left.setdefault(kind, set()).update(listed.stdout.split())
        if any(left.values()):
            raise CheckFailed(f"left behind: {left}")
        images = run("docker", "images", "--format", "{{.Repository}}", "--filter", "reference=natsllm*").stdout.split()
        images += run("docker", "images", "--format", "{{.Repository}}", "--filter", "reference=natsllm-base/*").stdout.split()
        return (f"no container, network or volume of the project is left; kept for the next run: the images "
                f"{', '.join(sorted(set(images)))} and their build cache")

    # ---- the whole run

    def main(self) -> int:
        print(f"compose-check: {ROOT} as compose project {PROJECT!r}; work files in {self.workdir}", flush=True)
        failed = False
        try:
            for name in STEPS:
                self.step(name, getattr(self, name.replace("-", "_") + "_step"))
        except (Exception, KeyboardInterrupt) as e:
            failed = True
            if not isinstance(e, CheckFailed):
                traceback.print_exc()
                print(f"compose-check: stopped: {type(e).__name__}: {e}", flush=True)
            self.post_mortem()
        finally:
            self.cleanup()
        total = time.monotonic() - self.started
        print(f"compose-check: {'FAILED' if failed else 'passed'} in {total:.0f}s", flush=True)
        return 1 if failed else 0

    def post_mortem(self) -> None:
        if self.load is not None:
            self.load.stop(wait=False)
        if self.compose is None:
            return
        for container in self.compose.containers(all_states=True):
            state = health(container)
            if state != "healthy":
                tail = run("docker", "logs", "--tail", "30", container, check=False).stdout
                print(f"--- {container} ({state}), last lines:\n{tail}", flush=True)

    def cleanup(self) -> None:
        if self.compose is not None and self.compose.containers(all_states=True) + self.volumes():
            self.compose("--profile", "pd", "down", "-v", "--remove-orphans", check=False, timeout=600)
        for path in self.lent:
            path.unlink(missing_ok=True)
        if not self.keep_engine:
            said = self.engine.stop()
            if said:
                print(f"{'engine':<15} {said}", flush=True)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def volumes(self) -> list[str]:
        label = f"label=com.docker.compose.project={PROJECT}"
        return run("docker", "volume", "ls", "-q", "--filter", label, check=False).stdout.split()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep-engine", action="store_true", help="leave a dockerd this check started running")
    args = parser.parse_args()
    return Check(args.keep_engine).main()


if __name__ == "__main__":
    sys.exit(main())
