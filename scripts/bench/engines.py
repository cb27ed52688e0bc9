"""The engines the benchmarks run, built from the same flags as ``scripts/serve``.

``engine(flags)`` is the in-process engine (scheduler and one worker in this process, every
step a msgpack round trip: ``services/engine.py``) with the settings a worker of
``scripts/serve`` would have for those flags (``--dtype bfloat16 --max-num-seqs 32``...;
the same parser, the same defaults, environment variables included). ``stack(flags)``
starts the whole stack as ``scripts/serve`` does, on a free port, and stops it after;
``cpu_seconds(stack)`` is the CPU time its processes have used so far (what a figure on a
shared machine is better read against than the wall clock).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os


def engine_configs(flags: list[str] = (), **defaults):
    """(run, cache, scheduler, lora) configs of a worker started with ``flags``; ``defaults``
    (config field names) apply where ``flags`` do not name the setting."""
    from services.worker.__main__ import build_parser
    from shared.cli import config_from_args
    from shared.config import CacheConfig, LoRAConfig, ModelRunConfig, SchedulerConfig

    parser = build_parser()
    parser.set_defaults(**{name: value for name, value in defaults.items()
                           if f"--{name.replace('_', '-')}" not in flags})
    args = parser.parse_args(list(flags))
    return tuple(config_from_args(cls, args) for cls in (ModelRunConfig, CacheConfig, SchedulerConfig, LoRAConfig))


def engine(flags: list[str] = (), **defaults):
    """The in-process engine for ``flags`` (see ``engine_configs``)."""
    from services.engine import Engine

    run, cache, scheduler, lora = engine_configs(flags, **defaults)
    return Engine(run, cache, scheduler, lora_config=lora)


def with_settings(config, **changes):
    """``config`` with fields changed (a frozen config dataclass)."""
    return dataclasses.replace(config, **changes)


@contextlib.contextmanager
def stack(flags: list[str] = (), timeout: float = 300.0, **config):
    """The whole stack as ``scripts/serve`` runs it (``flags``: its service flags; ``config``:
    ``StackConfig`` fields, e.g. ``prefill_engines=1``), on a free port; yields the
    ``Stack`` (its ``base_url``) once it serves, and stops it after."""
    from services.launch.nats_server import free_port
    from services.launch.stack import Stack, StackConfig

    running = Stack(StackConfig(**{"port": free_port(), **config, "args": list(flags)}))
    running.start()
    try:
        running.wait_ready(timeout=timeout)
        yield running
    finally:
        running.stop()


def cpu_seconds_by_process(running) -> dict[str, float]:
    """User + system CPU seconds of each process of a running ``Stack`` (by its name in
    the supervisor: ``gateway``, ``worker-0``..., ``nats-server``)."""
    seconds = {}
    for name, child in running.supervisor.children.items():
        try:
            fields = open(f"/proc/{child.process.pid}/stat").read().rsplit(")", 1)[1].split()
        except (OSError, AttributeError):
            continue
        seconds[name] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return seconds


def cpu_seconds(running) -> float:
    """User + system CPU seconds of every process of a running ``Stack`` (nats-server too)."""
    return sum(cpu_seconds_by_process(running).values())
