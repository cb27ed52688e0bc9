"""The gateway's settings: one frozen dataclass, filled from flags (``__main__``).

Fields made with ``setting`` are flags; ``served_model_names`` comes from the
``--served-model-name`` and ``--model`` flags (``__main__``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from shared.config import ConfigError, LoRAConfig, setting

from .tool_parsers import TOOL_PARSERS

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_served_model_name(model: str) -> str:
    """The name clients use for ``model``: the model file's or folder's base name
    (without ``.gguf``), or the default model's name."""
    name = os.path.basename(os.path.normpath(model)) if model else ""
    if name.lower().endswith(".gguf"):
        name = name[: -len(".gguf")]
    return name or DEFAULT_MODEL_NAME


@dataclass(frozen=True)
class GatewayConfig:
    host: str = setting("127.0.0.1", "address to listen on (0.0.0.0 in docker)")
    port: int = setting(8000, "HTTP port")  # 0: any free port (tests)
    served_model_names: tuple[str, ...] = (DEFAULT_MODEL_NAME,)
    model: str = ""  # the base model's path (--model; "": the default model): adapters are checked against it
    lora: LoRAConfig = LoRAConfig()  # the --enable-lora, --max-lora-rank and --lora-modules flags
    api_key: str = setting("", "when set, /v1 routes (and /metrics) need 'Authorization: Bearer <key>'")
    metrics_public: bool = setting(False, "with --api-key, serve /metrics without the key")
    request_timeout: float = setting(600.0, "seconds for a whole request")
    tokenize_timeout: float = setting(10.0, "seconds to wait for the tokenizer service's answer")
    health_timeout: float = 0.5  # seconds a tokenizer has to answer /health's ping
    shutdown_timeout: float = 5.0  # seconds open connections get to close on shutdown
    access_log: bool = setting(True, "log one line per HTTP request")
    max_request_body_bytes: int = setting(
        8 * 1024 * 1024, "bodies over this many bytes get 413 (a prompt must also fit in one bus message)")
    engine_ready_ttl: float = setting(
        3.0, "/health counts an engine as ready if its stats (sent every second) said so within this many seconds")
    engine_heartbeat_timeout: float = setting(
        5.0, "seconds of engine silence after which its open requests resume on another engine")
    engine_resume_timeout: float = setting(
        60.0, "seconds a lost engine's request may look for an engine to go on (then 503, engine_lost)")
    stream_idle_timeout: float = setting(
        0.0, "a stream that got no token for this many seconds ends with 504 (0: only --request-timeout)")
    stream_interval: int = setting(
        1, "streamed responses: a choice's tokens are sent in chunks of this many (its first and last at once; "
           "services/gateway/stream_interval.py); 1: each step's tokens as they come. vLLM's flag")
    enable_prompt_tokens_details: bool = setting(
        True, "usage.prompt_tokens_details.cached_tokens (prompt tokens found in the prefix cache or the KV "
              "tiers) in responses; vLLM's flag, on here unless --no-enable-prompt-tokens-details")
    return_tokens_as_token_ids: bool = setting(
        False, "logprobs name each token 'token_id:<id>' unless a request's return_tokens_as_token_ids says "
               "otherwise; vLLM's flag")
    enable_auto_tool_choice: bool = setting(
        False, 'tool_choice "auto": the model decides when to call tools (needs --tool-call-parser)')
    tool_call_parser: str = setting(
        "", f"how the model's text is read as tool calls under tool_choice auto: {', '.join(TOOL_PARSERS)}")

    def __post_init__(self) -> None:
        if self.tool_call_parser and self.tool_call_parser not in TOOL_PARSERS:
            raise ConfigError(f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)}, got {self.tool_call_parser!r}")
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ConfigError("enable_auto_tool_choice needs a tool_call_parser")
        if self.stream_idle_timeout < 0:
            raise ConfigError(f"stream_idle_timeout must be >= 0 seconds, got {self.stream_idle_timeout}")
        if self.stream_interval < 1:
            raise ConfigError(f"stream_interval must be >= 1, got {self.stream_interval}")
        if not self.served_model_names or not all(self.served_model_names):
            raise ConfigError(f"served_model_names must be non-empty names, got {self.served_model_names!r}")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        if self.max_request_body_bytes < 1024:
            raise ConfigError(f"max_request_body_bytes must be >= 1024, got {self.max_request_body_bytes}")
        for name in ("request_timeout", "tokenize_timeout", "health_timeout", "shutdown_timeout",
                     "engine_ready_ttl", "engine_heartbeat_timeout", "engine_resume_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0 seconds, got {getattr(self, name)}")

    @property
    def model_name(self) -> str:
        """The name responses report."""
        return self.served_model_names[0]
