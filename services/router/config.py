"""The router's settings (the tokenizer service takes them as flags)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import ConfigError, setting

ROUTER_MODES = ("kv", "least-loaded", "round-robin", "random")


@dataclass(frozen=True)
class RouterConfig:
    router_mode: str = setting(
        "kv", "which engine takes a request: kv (the engine holding most of its prompt's blocks in its prefix "
              "cache, weighed against its load; by load alone where no engine holds any) | least-loaded | "
              "round-robin | random. With one engine all are the same")
    router_busy_threshold: float = setting(
        0.95, "an engine whose KV cache is at least this full while requests wait there is skipped while "
              "another is not")

    def __post_init__(self) -> None:
        if self.router_mode not in ROUTER_MODES:
            raise ConfigError(f"router_mode must be one of {', '.join(ROUTER_MODES)}, got {self.router_mode!r}")
        if not 0.0 < self.router_busy_threshold <= 1.0:
            raise ConfigError(f"router_busy_threshold must be in (0, 1], got {self.router_busy_threshold}")
