"""A service's liveness file, and ``python -m shared.healthcheck`` that reads it.

Every ``shared.bus.Service`` rewrites its heartbeat file every ``HEARTBEAT_INTERVAL``
seconds, but only after a round trip to nats-server succeeded: a fresh file proves
that the process's event loop runs and its bus connection is up. The check needs no
bus permissions (a container healthcheck runs it beside the service):

    python -m shared.healthcheck [--max-age SECONDS] [--show]

exits 0 when the file was written within ``--max-age`` seconds, 1 otherwise (a
blocked loop, a lost bus connection, a dead or never started service), and 1 while the
file says the service is still starting (``shared/startup.py``: loading weights,
compiling kernels..., before it is on the bus). The file is
``HEARTBEAT_FILE`` from the environment, else ``DEFAULT_HEARTBEAT_FILE`` (one per
container; processes on one host that share it only keep each other's file fresh).
It holds what the service answers to a ping, as JSON: its name, instance id and
counters (``Service.info()``); ``--show`` prints it, so each container of a scaled
service says what it did (``docker compose exec --index 2 tokenizer python -m
shared.healthcheck --show``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

DEFAULT_HEARTBEAT_FILE = "/tmp/natsllm.heartbeat"
HEARTBEAT_INTERVAL = 2.0  # seconds between a service's touches
MAX_AGE = 15.0  # seconds after which the check calls the service dead


def heartbeat_file(environ=os.environ) -> str:
    return environ.get("HEARTBEAT_FILE") or DEFAULT_HEARTBEAT_FILE


def beat(path: str, status: dict) -> None:
    """Write ``status`` to ``path`` whole (a reader never sees half of it)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        json.dump(status, f, default=str)
    os.replace(tmp, path)


def age(path: str) -> float:
    """Seconds since ``path`` was touched (infinite if it does not exist)."""
    try:
        return time.time() - os.stat(path).st_mtime
    except FileNotFoundError:
        return float("inf")


def read(path: str) -> dict:
    """What the file holds ({} if it is missing or not JSON, as while being replaced)."""
    try:
        with open(path) as f:
            status = json.load(f)
    except (OSError, ValueError):
        return {}
    return status if isinstance(status, dict) else {}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Exit 0 if this container's service beats recently")
    parser.add_argument("--file", default=heartbeat_file(), help="heartbeat file [env HEARTBEAT_FILE]")
    parser.add_argument("--max-age", type=float, default=MAX_AGE, help="seconds a beat counts")
    parser.add_argument("--show", action="store_true", help="print the service's status the file holds")
    args = parser.parse_args(argv)
    seconds = age(args.file)
    if args.show and seconds != float("inf"):
        with open(args.file) as f:
            print(f.read())
    if seconds > args.max_age:
        print(f"unhealthy: {args.file} last touched {seconds:.1f}s ago (limit {args.max_age:g}s)", file=sys.stderr)
        return 1
    status = read(args.file)
    if status.get("starting"):
        print(f"starting: {status.get('phase', '')}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
