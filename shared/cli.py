"""Command-line flags whose defaults come from environment variables.

Every service takes its settings as ``--flag`` with an ``ENV_VAR`` default, so the
same image runs under ``scripts/serve`` (flags) and docker compose (env). A bad
environment value fails at start-up with a message naming the key and the value.
The flags of a config dataclass come from its ``setting`` fields (``shared/config.py``):
``add_config_flags`` declares them, ``config_from_args`` builds the config back.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing

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


def optional_int(value: str) -> int | None:
    return None if value in ("", "none", "None") else int(value)


def add_flag(parser: argparse.ArgumentParser, flag: str, env_name: str, default, cast=str, help: str = "") -> None:
    """Add ``--flag`` (type ``cast``) defaulting to ``$env_name``, else ``default``."""
    value = env(env_name, default, cast)
    if cast is bool:
        parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=value, help=f"{help} [env {env_name}]")
    else:
        parser.add_argument(flag, type=cast, default=value, help=f"{help} [env {env_name}]")


def _flag_fields(config_cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(config_cls) if "help" in f.metadata]


def _cast(annotation):
    """The flag's value type for a field's type: ``int | None`` takes "" or "none" as None."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        (inner,) = [a for a in typing.get_args(annotation) if a is not type(None)]
        if inner is not int:
            raise TypeError(f"no flag type for {annotation}")
        return optional_int
    return annotation


def add_config_flags(parser: argparse.ArgumentParser, config_cls) -> None:
    """A ``--field-name`` flag (env ``FIELD_NAME``) for each ``setting`` field of ``config_cls``."""
    hints = typing.get_type_hints(config_cls)
    for f in _flag_fields(config_cls):
        add_flag(parser, "--" + f.name.replace("_", "-"), f.name.upper(), f.default, _cast(hints[f.name]),
                 help=f.metadata["help"])


def config_from_args(config_cls, args: argparse.Namespace, **fields):
    """``config_cls`` from the parsed flags of its ``setting`` fields, plus ``fields``."""
    values = {f.name: getattr(args, f.name) for f in _flag_fields(config_cls)}
    return config_cls(**{**values, **fields})


def base_parser(description: str, metrics_port: bool = True) -> argparse.ArgumentParser:
    """The flags every service takes: the bus, logging, tracing and (``metrics_port``: the
    services without an HTTP port of their own) where their Prometheus metrics are served."""
    from shared.service_metrics import MetricsServerConfig
    from shared.tracing import TracingConfig

    parser = argparse.ArgumentParser(description=description)
    add_flag(parser, "--nats-url", "NATS_URL", "nats://127.0.0.1:4222",
             help="NATS server URL, or a cluster's node URLs comma-separated")
    add_flag(parser, "--log-level", "LOG_LEVEL", "INFO", help="logging level")
    add_config_flags(parser, TracingConfig)
    if metrics_port:
        add_config_flags(parser, MetricsServerConfig)
    return parser


def begin_service(args: argparse.Namespace, service: str) -> None:
    """What each service's ``__main__`` does once its flags are parsed: its start-up status
    (``shared/startup.py``) and its tracing (``shared/tracing.py``)."""
    from shared import startup, tracing

    startup.begin(service)
    tracing.configure(config_from_args(tracing.TracingConfig, args), service)


def metrics_server_config(args: argparse.Namespace):
    from shared.service_metrics import MetricsServerConfig

    return config_from_args(MetricsServerConfig, args)
