"""Flags shared by the scheduler and worker services (and scripts), with env defaults.

The scheduler and every worker of one engine must agree on these (block size,
batch limits), so they are declared once here and turned into the config
dataclasses of ``shared/config.py``.
"""

from __future__ import annotations

import argparse

from shared.cli import add_flag
from shared.config import CacheConfig, ModelRunConfig, ParallelConfig, SchedulerConfig


def _optional_int(value: str) -> int | None:
    return None if value in ("", "none", "None") else int(value)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--engine-id", "ENGINE_ID", "0", help="engine (model replica) id shared by its scheduler and workers")
    add_flag(parser, "--model", "MODEL", "", help="GGUF file or Hugging Face folder ('' = the default SmolLM2 model)")
    add_flag(parser, "--max-model-len", "MAX_MODEL_LEN", None, _optional_int, help="context length cap")
    add_flag(parser, "--block-size", "BLOCK_SIZE", 16, int, help="tokens per KV cache block")
    add_flag(parser, "--num-gpu-blocks", "NUM_GPU_BLOCKS", None, _optional_int, help="explicit KV cache size in blocks")
    add_flag(parser, "--gpu-memory-utilization", "GPU_MEMORY_UTILIZATION", 0.9, float, help="fraction of GPU memory to use")
    add_flag(parser, "--cpu-kv-cache-gib", "CPU_KV_CACHE_GIB", 1.0, float, help="KV cache size on CPU in GiB")
    add_flag(parser, "--enable-prefix-caching", "ENABLE_PREFIX_CACHING", True, bool, help="prefix caching")
    add_flag(parser, "--max-num-batched-tokens", "MAX_NUM_BATCHED_TOKENS", 2048, int, help="token budget per step")
    add_flag(parser, "--max-num-seqs", "MAX_NUM_SEQS", 128, int, help="max requests per step")
    add_flag(parser, "--async-scheduling", "ASYNC_SCHEDULING", True, bool, help="schedule and send step N+1 while step N runs")
    add_flag(parser, "--long-prefill-token-threshold", "LONG_PREFILL_TOKEN_THRESHOLD", 0, int, help="max prompt chunk per request and step (0 = no cap)")
    add_flag(parser, "--dtype", "DTYPE", "auto", help="auto|float32|bfloat16|float16")
    add_flag(parser, "--device", "DEVICE", "auto", help="auto|cpu|cuda|cuda:N")
    add_flag(parser, "--kernel-backend", "KERNEL_BACKEND", "auto", help="auto|torch|triton")
    add_flag(parser, "--cpu-prepack", "CPU_PREPACK", True, bool, help="CPU: oneDNN-prepacked weight matrices")
    add_flag(parser, "--tensor-parallel-size", "TENSOR_PARALLEL_SIZE", 1, int, help="ranks per engine")
    add_flag(parser, "--rank", "RANK", 0, int, help="this worker's tensor-parallel rank")
    add_flag(parser, "--dist-init-method", "DIST_INIT_METHOD", "", help="torch.distributed rendezvous, e.g. tcp://host:29500")
    add_flag(parser, "--seed", "SEED", 0, int, help="seed of the worker's shared sampling generator")
    add_flag(parser, "--profile-steps", "PROFILE_STEPS", False, bool, help="time each step's phases (scripts/bench_overhead.py)")


def cache_config(args) -> CacheConfig:
    return CacheConfig(
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization,
        cpu_kv_cache_gib=args.cpu_kv_cache_gib,
        enable_prefix_caching=args.enable_prefix_caching,
    )


def scheduler_config(args) -> SchedulerConfig:
    return SchedulerConfig(
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        async_scheduling=args.async_scheduling,
    )


def run_config(args) -> ModelRunConfig:
    return ModelRunConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        kernel_backend=args.kernel_backend,
        cpu_prepack=args.cpu_prepack,
        max_model_len=args.max_model_len,
        seed=args.seed,
    )


def parallel_config(args) -> ParallelConfig:
    return ParallelConfig(
        tensor_parallel_size=args.tensor_parallel_size,
        rank=args.rank,
        dist_init_method=args.dist_init_method,
    )
