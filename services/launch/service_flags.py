"""Which service takes which of the extra flags given to ``scripts/serve``.

A flag the launcher does not handle itself goes only to the services whose parser
declares it (``build_parser`` in each ``services/<name>/__main__.py``): e.g.
``--served-model-name`` to the gateway, ``--max-num-seqs`` to the scheduler and the
workers, ``--max-model-len`` to them and the tokenizers. A flag no service takes is
an error before anything starts.
"""

from __future__ import annotations

import functools
import importlib

from shared.config import ConfigError

SERVICES = ("worker", "scheduler", "tokenizer", "detokenizer", "gateway")


@functools.cache
def service_flags(service: str) -> frozenset[str]:
    """Every option string ``python -m services.<service>`` accepts."""
    parser = importlib.import_module(f"services.{service}.__main__").build_parser()
    return frozenset(parser._option_string_actions)


def _flag_groups(args: list[str]) -> list[tuple[str, list[str]]]:
    """``args`` as (flag, [the flag and its values]): a value belongs to the flag before it."""
    groups: list[tuple[str, list[str]]] = []
    for arg in args:
        if arg.startswith("--"):
            groups.append((arg.split("=", 1)[0], [arg]))
        elif groups:
            groups[-1][1].append(arg)
        else:
            raise ConfigError(f"{arg!r} is not a flag (flags start with --)")
    return groups


def split_service_args(args: list[str]) -> dict[str, list[str]]:
    """Each service's share of ``args``, in their order."""
    shares: dict[str, list[str]] = {service: [] for service in SERVICES}
    for flag, group in _flag_groups(args):
        takers = [service for service in SERVICES if flag in service_flags(service)]
        if not takers:
            raise ConfigError(f"no service takes the flag {flag}")
        for service in takers:
            shares[service].extend(group)
    return shares
