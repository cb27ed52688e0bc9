"""Command-line flags whose defaults come from environment variables.

Every service takes its settings as ``--flag`` with an ``ENV_VAR`` default, so the
same image runs under ``scripts/serve`` (flags) and docker compose (env). A bad
environment value fails at start-up with a message naming the key and the value.
"""

from __future__ import annotations

import argparse
import os

from shared.config import ConfigError

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env(name: str, default, cast=str):
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        if cast is bool:
            lowered = raw.strip().lower()
            if lowered not in _TRUE | _FALSE:
                raise ValueError(raw)
            return lowered in _TRUE
        return cast(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} is not a valid {cast.__name__}") from None


def add_flag(parser: argparse.ArgumentParser, flag: str, env_name: str, default, cast=str, help: str = "") -> None:
    """Add ``--flag`` (type ``cast``) defaulting to ``$env_name``, else ``default``."""
    value = env(env_name, default, cast)
    if cast is bool:
        parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=value, help=f"{help} [env {env_name}]")
    else:
        parser.add_argument(flag, type=cast, default=value, help=f"{help} [env {env_name}]")


def base_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    add_flag(parser, "--nats-url", "NATS_URL", "nats://127.0.0.1:4222", help="NATS server URL")
    add_flag(parser, "--log-level", "LOG_LEVEL", "INFO", help="logging level")
    return parser
