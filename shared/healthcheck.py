"""A service's liveness file, and ``python -m shared.healthcheck`` that reads it.

Every ``shared.bus.Service`` touches its heartbeat file every ``HEARTBEAT_INTERVAL``
seconds, but only after a round trip to nats-server succeeded: a fresh file proves
that the process's event loop runs and its bus connection is up. The check needs no
bus permissions (a container healthcheck runs it beside the service):

    python -m shared.healthcheck [--max-age SECONDS]

exits 0 when the file was touched within ``--max-age`` seconds, 1 otherwise (a
blocked loop, a lost bus connection, a dead or never started service). The file is
``HEARTBEAT_FILE`` from the environment, else ``DEFAULT_HEARTBEAT_FILE`` (one per
container; processes on one host that share it only keep each other's file fresh).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

DEFAULT_HEARTBEAT_FILE = "/tmp/natsllm.heartbeat"
HEARTBEAT_INTERVAL = 2.0  # seconds between a service's touches
MAX_AGE = 15.0  # seconds after which the check calls the service dead


def heartbeat_file(environ=os.environ) -> str:
    return environ.get("HEARTBEAT_FILE") or DEFAULT_HEARTBEAT_FILE


def touch(path: str) -> None:
    with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)):
        pass
    os.utime(path)


def age(path: str) -> float:
    """Seconds since ``path`` was touched (infinite if it does not exist)."""
    try:
        return time.time() - os.stat(path).st_mtime
    except FileNotFoundError:
        return float("inf")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Exit 0 if this container's service beats recently")
    parser.add_argument("--file", default=heartbeat_file(), help="heartbeat file [env HEARTBEAT_FILE]")
    parser.add_argument("--max-age", type=float, default=MAX_AGE, help="seconds a beat counts")
    args = parser.parse_args(argv)
    seconds = age(args.file)
    if seconds > args.max_age:
        print(f"unhealthy: {args.file} last touched {seconds:.1f}s ago (limit {args.max_age:g}s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
