"""Chaos run: continuous mixed load on a stack started by ``scripts/serve`` while a random
process of it is killed (SIGKILL) every 10-30 s; then a check that nothing was lost.

    .venv/bin/python scripts/chaos.py                       # 10 minutes, every process a target
    .venv/bin/python scripts/chaos.py --minutes 2 --tp 3 --json report.json  # the default model: 3 ranks
    .venv/bin/python scripts/chaos.py --spare scheduler     # the scheduler left out of the kill set
    .venv/bin/python scripts/chaos.py --data-parallel-size 2 --nats-cluster 3  # other flags go to scripts/serve

The load: ``--concurrency`` clients send chat and completion requests, streamed and not,
greedy and sampled (seeded, ``n`` up to 3), some with stop strings, and about one in ten
goes away early (after its first chunk, or by a short timeout). The greedy ones come from
a fixed pool whose texts were first taken from the same stack before any kill (a
fault-free run of the same requests); every greedy text completed under chaos must equal
its fault-free text. The targets: every service process the launcher started (gateway,
tokenizers, detokenizers, scheduler, each worker rank) and nats-server, found as the
launcher's children.

The report: requests sent, completed, left early by the client, failed (by error, each
with the kill it followed and how long after), hung (no answer within ``--hung-after``
seconds: must be 0), greedy texts differing from the fault-free run (must be 0), the
requests and KV blocks the engine holds once idle (must be 0), connections refused while
the gateway restarted (retried, not failures), the kills, each process's memory (RSS) and
restart count, and whether the launcher stopped cleanly at the end. The exit status is 1
when a must-be-0 figure is not 0 or a failure follows no kill.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.soak import engine_gauges, rss_mib  # noqa: E402
from services.launch.nats_server import free_port  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
KILL_EVERY = (10.0, 30.0)  # seconds between kills, drawn uniformly
HUNG_AFTER = 180.0  # a request with no end by then is hung
# A failure counts as caused by a kill when it ends within this many seconds of one (a
# lost worker's requests wait up to the scheduler's step timeout, 60 s, before resuming).
BLAME_WINDOW = 90.0
IDLE_TIMEOUT = 90.0  # for the engine to report no request and no KV block after the load
WORDS = ("the a sea ship wind stone river light and of harbour storm sail rope gull tide north south whale "
         "island fog lantern anchor wave").split()


@dataclass
class Spec:
    """One request: its route and body, and whether the client leaves early."""

    route: str
    body: dict
    leave_early: bool = False

    @property
    def greedy(self) -> bool:
        return self.body.get("temperature") == 0


def make_spec(rng: random.Random, greedy: bool, leave_early: bool = False) -> Spec:
    chat = rng.random() < 0.5
    body: dict = {"model": MODEL, "max_tokens": rng.randint(4, 48), "stream": rng.random() < 0.6,
                  "n": rng.choice([1, 1, 2]) if greedy else rng.choice([1, 2, 3])}
    if greedy:
        body["temperature"] = 0
    else:
        body["temperature"], body["seed"] = 0.8, rng.randint(0, 10_000)
    if rng.random() < 0.3:
        body["stop"] = rng.sample(WORDS, rng.randint(1, 2))
    length = rng.choice([3, 10, 30, 80, 200]) + rng.randint(0, 20)
    text = " ".join(rng.choices(WORDS, k=length))
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
        return Spec("/v1/chat/completions", body, leave_early)
    body["prompt"] = text
    return Spec("/v1/completions", body, leave_early)


def greedy_pool(size: int, seed: int) -> list[Spec]:
    rng = random.Random(seed)
    return [make_spec(rng, greedy=True) for _ in range(size)]


@dataclass
class Outcome:
    kind: str  # completed | left_early | failed | hung | refused
    texts: list[str] = field(default_factory=list)
    error: str = ""
    ended_at: float = 0.0


def _choice_text(choice: dict) -> str:
    return choice.get("text") or (choice.get("message") or choice.get("delta") or {}).get("content") or ""


async def _send(http: httpx.AsyncClient, spec: Spec) -> Outcome:
    body = spec.body
    if body["stream"]:
        texts = [""] * body["n"]
        async with http.stream("POST", spec.route, json=body) as r:
            if r.status_code != 200:
                return Outcome("failed", error=f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
            done = False
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                    continue
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    return Outcome("failed", error=f"stream error event: {json.dumps(event['error'])[:300]}")
                for choice in event.get("choices", []):
                    texts[choice["index"]] += _choice_text(choice)
                if spec.leave_early:
                    return Outcome("left_early")  # closing the stream is the client going away
            if not done:
                return Outcome("failed", error="stream ended without [DONE]")
            return Outcome("completed", texts)
    r = await http.post(spec.route, json=body, timeout=0.3 if spec.leave_early else HUNG_AFTER)
    if r.status_code != 200:
        return Outcome("failed", error=f"HTTP {r.status_code}: {r.text[:300]}")
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    return Outcome("completed", [_choice_text(c) for c in choices])


async def send(http: httpx.AsyncClient, spec: Spec, hung_after: float = HUNG_AFTER) -> Outcome:
    """One request to its end; a refused connection (the gateway restarting) is retried."""
    deadline = time.monotonic() + hung_after
    refused = 0
    while True:
        try:
            outcome = await asyncio.wait_for(_send(http, spec), max(0.1, deadline - time.monotonic()))
        except httpx.ConnectError:
            refused += 1
            if time.monotonic() > deadline:
                outcome = Outcome("hung", error="the gateway refused connections until the deadline")
            else:
                await asyncio.sleep(0.5)
                continue
        except (asyncio.TimeoutError, httpx.TimeoutException) as e:
            if spec.leave_early and isinstance(e, httpx.TimeoutException):
                outcome = Outcome("left_early")
            else:
                outcome = Outcome("hung", error=f"no end within {hung_after:g} s")
        except (httpx.HTTPError, json.JSONDecodeError) as e:
            outcome = Outcome("failed", error=f"{type(e).__name__}: {e}"[:300])
        outcome.ended_at = time.monotonic()
        if refused:
            outcome.error = (outcome.error + f" (after {refused} refused connection(s))").strip()
        return outcome


# ------------------------------------------------------------------ the stack's processes


def _stat_fields(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def process_name(argv: list[str]) -> str | None:
    """A launcher child's name from its command line: nats-server, gateway, tokenizer,
    detokenizer, scheduler or worker-<rank> (a P/D engine's ``<engine id>-`` in front)."""
    if not argv:
        return None
    if os.path.basename(argv[0]) == "nats-server":
        return "nats-server"
    if "-m" not in argv:
        return None
    role = argv[argv.index("-m") + 1].removeprefix("services.")
    prefix = f"{argv[argv.index('--engine-id') + 1]}-" if "--engine-id" in argv else ""
    if role == "worker":
        return f"{prefix}worker-{argv[argv.index('--rank') + 1] if '--rank' in argv else 0}"
    return f"{prefix}{role}"


def stack_processes(launcher_pid: int) -> dict[str, int]:
    """The launcher's live children by name (replicas numbered by pid order: tokenizer#0, ...)."""
    found: list[tuple[str, int]] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            fields = _stat_fields(pid)
            if int(fields[1]) != launcher_pid or fields[0] == "Z":
                continue
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
        except (OSError, IndexError, ValueError):
            continue
        name = process_name(argv)
        if name is not None:
            found.append((name, pid))
    names: dict[str, int] = {}
    for name, pid in sorted(found, key=lambda item: item[1]):
        replicas = sum(1 for n, _ in found if n == name)
        if replicas > 1:
            name = f"{name}#{sum(1 for n in names if n.startswith(name + '#'))}"
        names[name] = pid
    return names


def kind_of(name: str) -> str:
    """tokenizer#1 -> tokenizer; worker-1 -> worker-1."""
    return name.split("#", 1)[0]


class Launched:
    """``scripts/serve`` (or ``command``) as a child process: the real launcher path."""

    def __init__(self, port: int, args: list[str], log_path: Path, command: list[str] | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        argv = [*(command or [str(ROOT / "scripts" / "serve")]), "--port", str(port), *args]
        self.process = subprocess.Popen(argv, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                        env={**os.environ, **(env or {})})

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the launcher exited with {self.process.returncode}; see {self.log_path}")
            if self.healthy():
                return
            time.sleep(0.5)
        raise TimeoutError(f"the stack was not ready within {timeout:g} s; see {self.log_path}")

    def healthy(self) -> bool:
        try:
            return httpx.get(self.base_url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def processes(self) -> dict[str, int]:
        return stack_processes(self.process.pid)

    def stop(self, timeout: float = 15.0) -> tuple[int | None, float, list[int]]:
        """SIGTERM the launcher: (its exit code or None if it had to be killed, the seconds it
        took, pids of its children still alive afterwards)."""
        children = list(self.processes().values())
        start = time.monotonic()
        code: int | None = None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        took = time.monotonic() - start
        time.sleep(0.5)
        left = [pid for pid in children if _alive(pid)]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        self._log.close()
        return code, took, left


def _alive(pid: int) -> bool:
    try:
        return _stat_fields(pid)[0] != "Z"
    except OSError:
        return False


# ------------------------------------------------------------------ the run


@dataclass
class Kill:
    at: float  # seconds since the chaos phase began
    target: str
    pid: int


@dataclass
class Report:
    minutes: float
    tp: int
    spared: list[str]
    sent: int = 0
    completed: int = 0
    left_early: int = 0
    failed: list[dict] = field(default_factory=list)  # {"error", "at", "after_kill", "seconds_after"}
    unexplained_failures: int = 0  # failures that follow no kill within BLAME_WINDOW
    hung: list[dict] = field(default_factory=list)
    greedy_compared: int = 0
    greedy_differing: list[dict] = field(default_factory=list)
    refused_connections: int = 0
    kills: list[dict] = field(default_factory=list)
    engine_after: dict = field(default_factory=dict)  # the engines' gauges, summed, once idle
    leaked: bool = False
    check_after: int = 0  # greedy pool requests sent again in a fault-free pass after the chaos
    check_after_differing: int = 0  # of those, texts differing from the first fault-free run
    memory_mib: dict = field(default_factory=dict)  # name -> [RSS before the chaos, RSS after]
    restarts: dict = field(default_factory=dict)
    launcher_exit: dict = field(default_factory=dict)

    def failures_by_cause(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for f in self.failed:
            key = f"after killing {f['after_kill'] or 'nothing'}: {_error_kind(f['error'])}"
            counts[key] = counts.get(key, 0) + 1
        return dict(sorted(counts.items(), key=lambda kv: -kv[1]))

    @property
    def ok(self) -> bool:
        return (not self.hung and not self.greedy_differing and not self.leaked and not self.unexplained_failures
                and not self.check_after_differing and self.launcher_exit.get("left_running") == []
                and self.launcher_exit.get("code") == 0)


def _error_kind(error: str) -> str:
    """An error's gist for grouping: its code or type, or its first words."""
    for key in ('"code": "', '"type": "'):
        if key in error:
            value = error.split(key, 1)[1].split('"', 1)[0]
            if value and value != "null":
                return f"{error.split(':', 1)[0]} {value}"
    return error.split("(after", 1)[0][:80].strip()


async def reference_texts(base_url: str, pool: list[Spec], concurrency: int) -> list[list[str]]:
    """The pool's greedy texts from the stack as it is (before any kill)."""
    results: list[list[str] | None] = [None] * len(pool)
    queue = list(enumerate(pool))
    async with httpx.AsyncClient(base_url=base_url, timeout=HUNG_AFTER) as http:
        async def client() -> None:
            while queue:
                index, spec = queue.pop()
                outcome = await send(http, spec)
                if outcome.kind != "completed":
                    raise RuntimeError(f"fault-free run: request {index} {outcome.kind}: {outcome.error}")
                results[index] = outcome.texts

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return results  # type: ignore[return-value]


async def chaos_phase(stack: Launched, pool: list[Spec], refs: list[list[str]], report: Report, seconds: float,
                      concurrency: int, seed: int, kill_every: tuple[float, float], spare: set[str],
                      log=print) -> None:
    rng = random.Random(seed)
    start = time.monotonic()
    kills: list[Kill] = []

    async def killer() -> None:
        while True:
            await asyncio.sleep(rng.uniform(*kill_every))
            if time.monotonic() - start >= seconds:
                return
            targets = {name: pid for name, pid in stack.processes().items() if kind_of(name) not in spare}
            if not targets:
                continue
            name = rng.choice(sorted(targets))
            try:
                os.kill(targets[name], signal.SIGKILL)
            except ProcessLookupError:
                continue
            kills.append(Kill(time.monotonic() - start, name, targets[name]))
            log(f"  {kills[-1].at:6.1f}s  killed {name} (pid {targets[name]})")

    def blame(ended_at: float) -> tuple[str | None, float | None]:
        at = ended_at - start
        before = [k for k in kills if k.at <= at]
        if not before or at - before[-1].at > BLAME_WINDOW:
            return None, None
        return before[-1].target, round(at - before[-1].at, 1)

    async def client(index: int) -> None:
        local = random.Random(seed * 1000 + index)
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=HUNG_AFTER) as http:
            while time.monotonic() - start < seconds:
                draw = local.random()
                pool_index = None
                if draw < 0.5:
                    pool_index = local.randrange(len(pool))
                    spec = pool[pool_index]
                else:
                    spec = make_spec(local, greedy=draw < 0.6, leave_early=draw > 0.9)
                report.sent += 1
                outcome = await send(http, spec)
                if "refused connection" in outcome.error:
                    report.refused_connections += 1
                if outcome.kind == "completed":
                    report.completed += 1
                    if pool_index is not None:
                        report.greedy_compared += 1
                        if outcome.texts != refs[pool_index]:
                            report.greedy_differing.append({"pool_index": pool_index, "want": refs[pool_index],
                                                            "got": outcome.texts, "at": round(outcome.ended_at - start, 1)})
                elif outcome.kind == "left_early":
                    report.left_early += 1
                else:
                    target, after = blame(outcome.ended_at)
                    entry = {"error": outcome.error, "at": round(outcome.ended_at - start, 1), "after_kill": target,
                             "seconds_after": after}
                    (report.hung if outcome.kind == "hung" else report.failed).append(entry)
                    if outcome.kind == "failed" and target is None:
                        report.unexplained_failures += 1

    killing = asyncio.ensure_future(killer())
    await asyncio.gather(*(client(i) for i in range(concurrency)))
    killing.cancel()
    report.kills = [asdict(k) for k in kills]


def wait_idle(stack: Launched, timeout: float = IDLE_TIMEOUT, engines: float = 1) -> dict[str, float]:
    """The engines' gauges, summed, once the stack is healthy, hears from ``engines`` engines,
    and they hold no request and no KV block; or as they are at the deadline."""
    deadline = time.monotonic() + timeout
    gauges: dict[str, float] = {}
    while time.monotonic() < deadline:
        try:
            if stack.healthy():
                gauges = engine_gauges(stack.base_url)
                heard = _metric(stack.base_url, "natsllm:num_engines")
                gauges["natsllm:num_engines"] = heard
                if heard >= engines and not any(v for k, v in gauges.items() if k != "natsllm:num_engines"):
                    return gauges
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    return gauges


def _metric(base_url: str, name: str) -> float:
    for line in httpx.get(base_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def restart_counts(base_url: str) -> dict[str, float]:
    counts = {}
    for line in httpx.get(base_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith('natsllm:service_restarts_total{service="'):
            counts[line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
    return counts


def memory(stack: Launched) -> dict[str, float]:
    out = {}
    for name, pid in stack.processes().items():
        try:
            out[name] = round(rss_mib(pid), 1)
        except OSError:
            pass
    return out


def run(minutes: float = 10.0, tp: int = 1, concurrency: int = 16, seed: int = 0, pool_size: int = 160,
        spare: tuple[str, ...] = (), kill_every: tuple[float, float] = KILL_EVERY, serve_args: tuple[str, ...] = (),
        log_dir: Path | None = None, command: list[str] | None = None, log=print) -> Report:
    """The whole run; see the module docstring."""
    log_dir = Path(log_dir or ROOT / "build" / "chaos")
    log_dir.mkdir(parents=True, exist_ok=True)
    report = Report(minutes=minutes, tp=tp, spared=sorted(spare))
    args = ["--tp", str(tp), "--tokenizers", "2", "--detokenizers", "2", "--max-num-seqs", "64", *serve_args]
    if tp > 1 and "--omp-wait-policy" not in serve_args:
        args += ["--omp-wait-policy", "passive"]  # ranks share the cores (the flag's help)
    stack = Launched(free_port(), args, log_dir / "launcher.log", command, env={"LOG_LEVEL": "WARNING"})
    try:
        stack.wait_ready()
        pool = greedy_pool(pool_size, seed)
        log(f"stack up ({', '.join(sorted(stack.processes()))}); fault-free run of {pool_size} greedy requests")
        refs = asyncio.run(reference_texts(stack.base_url, pool, concurrency))
        before = memory(stack)
        engines = max(1.0, _metric(stack.base_url, "natsllm:num_engines"))
        log(f"chaos for {minutes:g} min: {concurrency} clients, a kill every {kill_every[0]:g}-{kill_every[1]:g} s"
            + (f", sparing {', '.join(sorted(spare))}" if spare else ""))
        asyncio.run(chaos_phase(stack, pool, refs, report, minutes * 60, concurrency, seed, kill_every, set(spare),
                                log))
        report.engine_after = wait_idle(stack, engines=engines)
        report.leaked = not report.engine_after or any(
            v for k, v in report.engine_after.items() if k != "natsllm:num_engines") or (
            report.engine_after.get("natsllm:num_engines", 0) < engines)
        check = pool[: min(len(pool), 48)]
        report.check_after = len(check)
        again = asyncio.run(reference_texts(stack.base_url, check, concurrency))
        report.check_after_differing = sum(a != b for a, b in zip(again, refs))
        after = memory(stack)
        report.memory_mib = {name: [before.get(name), after.get(name)] for name in sorted(set(before) | set(after))}
        report.restarts = restart_counts(stack.base_url)
    finally:
        code, took, left = stack.stop()
        report.launcher_exit = {"code": code, "seconds": round(took, 1), "left_running": left}
    return report


def print_report(report: Report, out=print) -> None:
    out(f"chaos run: {report.minutes:g} min, TP={report.tp}"
        + (f", sparing {', '.join(report.spared)}" if report.spared else ", every process a target"))
    out(f"  requests sent {report.sent}: completed {report.completed}, left early by the client "
        f"{report.left_early}, failed {len(report.failed)}, hung {len(report.hung)}")
    for cause, count in report.failures_by_cause().items():
        out(f"    failed {count:4d}  {cause}")
    out(f"  failures following no kill: {report.unexplained_failures}")
    out(f"  greedy texts compared with the fault-free run: {report.greedy_compared}, differing "
        f"{len(report.greedy_differing)}; after the chaos, a fault-free pass of {report.check_after}: "
        f"{report.check_after_differing} differing")
    out(f"  connections refused while the gateway restarted (retried): {report.refused_connections}")
    out(f"  engine once idle: {report.engine_after} -> {'LEAKED' if report.leaked else 'nothing left'}")
    kills: dict[str, int] = {}
    for k in report.kills:
        kills[kind_of(k["target"])] = kills.get(kind_of(k["target"]), 0) + 1
    out(f"  kills {len(report.kills)}: {dict(sorted(kills.items()))}")
    out(f"  restarts by the launcher: {report.restarts}")
    out("  memory (RSS MiB, before the chaos -> after):")
    for name, (before, after) in report.memory_mib.items():
        out(f"    {name:14s} {before if before is not None else '-':>7} -> {after if after is not None else '-':>7}")
    out(f"  launcher after SIGTERM: {report.launcher_exit}")
    out(f"  verdict: {'OK' if report.ok else 'FAILED'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pool", type=int, default=160, help="distinct greedy requests compared with the fault-free run")
    parser.add_argument("--spare", action="append", default=[],
                        help="a process kind never killed (nats-server, gateway, tokenizer, detokenizer, scheduler, "
                             "worker-<rank>); repeatable")
    parser.add_argument("--kill-every", type=float, nargs=2, default=KILL_EVERY, metavar=("MIN", "MAX"))
    parser.add_argument("--json", help="also write the report here")
    parser.add_argument("--log-dir", default=str(ROOT / "build" / "chaos"))
    args, serve_args = parser.parse_known_args()
    report = run(args.minutes, args.tp, args.concurrency, args.seed, args.pool, tuple(args.spare),
                 tuple(args.kill_every), tuple(serve_args), Path(args.log_dir))
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(report), indent=1))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
