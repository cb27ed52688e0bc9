"""Engine configuration: one frozen dataclass per concern, validated on creation.

Services fill these from CLI flags whose defaults come from environment variables
(see ``shared/engine_args.py``); nothing deep in the engine reads the environment.
"""

from __future__ import annotations

from dataclasses import dataclass


class ConfigError(ValueError):
    """A setting has a value the engine cannot run with; the message names it."""


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block size, pool size and prefix caching."""

    block_size: int = 16
    # Either an explicit block count, or a fraction of the device's memory.
    num_gpu_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    # On CPU the pool is sized from this many GiB unless num_gpu_blocks is set.
    cpu_kv_cache_gib: float = 1.0
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 1:
            raise ConfigError(f"num_gpu_blocks must be >= 1, got {self.num_gpu_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.cpu_kv_cache_gib <= 0:
            raise ConfigError(f"cpu_kv_cache_gib must be > 0, got {self.cpu_kv_cache_gib}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Token budget and batch limits of one engine step (V1: no prefill/decode phases)."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    # A prefill chunk of one request never exceeds this many tokens (0: no limit).
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    # The scheduler service sends step N+1 before step N's result is back (see
    # services/scheduler/scheduler.py); off: one step at a time.
    async_scheduling: bool = True

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.long_prefill_token_threshold < 0:
            raise ConfigError(
                "long_prefill_token_threshold must be >= 0, "
                f"got {self.long_prefill_token_threshold}"
            )


@dataclass(frozen=True)
class ModelRunConfig:
    """How a worker runs the model: which weights, dtype, device, kernels."""

    model: str = ""  # GGUF file or Hugging Face folder; "" = the default model
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"
    kernel_backend: str = "auto"  # auto | torch | triton
    cpu_prepack: bool = True  # CPU: reorder weight matrices once for oneDNN (services/worker/linear.py)
    max_model_len: int | None = None  # None: the model's own context length
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be auto|float32|bfloat16|float16, got {self.dtype!r}")
        if self.kernel_backend not in ("auto", "torch", "triton"):
            raise ConfigError(
                f"kernel_backend must be auto|torch|triton, got {self.kernel_backend!r}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {self.max_model_len}")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism: this process's rank among the engine's workers."""

    tensor_parallel_size: int = 1
    rank: int = 0
    dist_init_method: str = ""  # e.g. tcp://127.0.0.1:29500

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ConfigError(
                f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}"
            )
        if not 0 <= self.rank < self.tensor_parallel_size:
            raise ConfigError(
                f"rank must be in [0, {self.tensor_parallel_size}), got {self.rank}"
            )
