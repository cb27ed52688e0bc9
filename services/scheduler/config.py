"""The scheduler service's own settings (the engine's are in ``shared/config.py``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from shared.config import ConfigError, json_object_setting, setting


@dataclass(frozen=True)
class SchedulerServiceConfig:
    step_timeout: float = setting(60.0, "seconds to wait for a step's result")
    stats_interval: float = setting(1.0, "seconds between EngineStats messages")
    worker_timeout: float = setting(5.0, "seconds of worker silence that fail the engine")
    max_waiting_requests: int = setting(
        1024, "requests that may wait for a place in the batch; more are refused with 429 (Retry-After)")


# vLLM's --kv-events-config publishers: "null" publishes nothing, "nats" (ours) publishes
# on the bus. vLLM's "zmq" needs sockets this engine does not open.
KV_EVENTS_PUBLISHERS = ("null", "nats")
# The --kv-events-config keys honoured. vLLM's others configure its ZMQ publisher
# (endpoint, replay_endpoint, hwm, max_queue_size) or name a ZMQ topic.
_KV_EVENTS_KEYS = ("enable_kv_cache_events", "publisher", "buffer_steps", "topic")
DEFAULT_BUFFER_STEPS = 10_000  # vLLM's default


@dataclass(frozen=True)
class KVEventsConfig:
    """KV cache events (vLLM's flag, a JSON object): what enters and leaves the prefix cache,
    published on the bus for routers (``services/scheduler/kv_events.py``).

    After creation ``enabled`` says whether events are published and ``buffer_steps`` how
    many recent batches are kept for replays."""

    kv_events_config: str = setting(
        "", 'KV cache events as vLLM\'s JSON, e.g. {"enable_kv_cache_events": true, "publisher": "nats"} '
            '(publisher: nats = on the bus, llm.kv_events.<engine id>; null = none; also "buffer_steps": '
            f'batches kept for replays, default {DEFAULT_BUFFER_STEPS}); vLLM\'s ZMQ keys are refused. '
            "'' = no events")
    enabled: bool = field(init=False, default=False, compare=False)
    buffer_steps: int = field(init=False, default=DEFAULT_BUFFER_STEPS, compare=False)

    def __post_init__(self) -> None:
        values = json_object_setting("kv_events_config", self.kv_events_config)
        if values is None:
            return
        unknown = sorted(set(values) - set(_KV_EVENTS_KEYS))
        if unknown:
            raise ConfigError(f"kv_events_config: cannot honour {', '.join(unknown)} (events go on the NATS bus, "
                              f"not a ZMQ socket); it takes {', '.join(_KV_EVENTS_KEYS)}")
        enable = values.get("enable_kv_cache_events", False)
        if not isinstance(enable, bool):
            raise ConfigError(f"kv_events_config: enable_kv_cache_events must be true or false, got {enable!r}")
        publisher = values.get("publisher", "nats" if enable else "null")
        if publisher not in KV_EVENTS_PUBLISHERS:
            raise ConfigError(f"kv_events_config: publisher must be one of {', '.join(KV_EVENTS_PUBLISHERS)} "
                              f"(nats: on the bus; vLLM's zmq is not built), got {publisher!r}")
        buffer_steps = values.get("buffer_steps", DEFAULT_BUFFER_STEPS)
        if not isinstance(buffer_steps, int) or isinstance(buffer_steps, bool) or buffer_steps < 1:
            raise ConfigError(f"kv_events_config: buffer_steps must be an integer >= 1, got {buffer_steps!r}")
        if values.get("topic", "") != "":
            raise ConfigError(f"kv_events_config: topic must be '' (each engine publishes on its own subject, "
                              f"llm.kv_events.<engine id>), got {values['topic']!r}")
        object.__setattr__(self, "enabled", enable and publisher == "nats")
        object.__setattr__(self, "buffer_steps", buffer_steps)


def kv_events_config_json() -> str:
    """The ``--kv-events-config`` value that turns events on (the launcher's, for routers)."""
    return json.dumps({"enable_kv_cache_events": True, "publisher": "nats"})
