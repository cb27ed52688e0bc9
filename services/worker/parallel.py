"""Tensor parallelism: the process group of one engine's ranks and the TP collectives.

Every rank of an engine runs the same code on its shard of the model (see
``layers/``): column-parallel q/k/v and gate/up, row-parallel o_proj and
down_proj followed by an all-reduce, a vocab-parallel embedding (all-reduce) and a
vocab-parallel LM head whose logits are all-gathered, so every rank ends up with the
full logits and samples the same tokens.

``init_distributed`` joins the ranks through ``torch.distributed`` (NCCL on CUDA,
gloo on CPU) at ``ParallelConfig.dist_init_method``. With one rank it creates no
process group at all and ``TensorParallel.single()`` carries no-op collectives, so
TP=1 pays nothing; the model picks its code paths once, at construction.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from shared import startup
from shared.config import ConfigError, ParallelConfig
from shared.model_config import ModelConfig

logger = logging.getLogger(__name__)

# How long a rank waits in the rendezvous or in one collective for its peers.
DEFAULT_DIST_TIMEOUT = timedelta(minutes=5)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in the tensor-parallel group and its collectives.

    ``ordered_sums`` (batch invariance): a sum over more than two ranks adds the ranks'
    tensors in rank order, after an all-gather. A ring all-reduce adds each element in
    an order set by the chunk it falls in, and the chunks follow the tensor's size, so an
    element's sum would depend on the step's token count; over two ranks every order
    gives the same bits (a + b = b + a) and the all-reduce stays."""

    rank: int = 0
    world_size: int = 1
    group: object = field(default=None, compare=False, repr=False)
    ordered_sums: bool = False

    @classmethod
    def single(cls) -> "TensorParallel":
        return cls()

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def all_reduce(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """Sum over ranks (in place, returns the tensor); the identity with one rank."""
        return self._all_reduce if self.enabled else _identity

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.ordered_sums and self.world_size > 2:
            parts = [torch.empty_like(x) for _ in range(self.world_size)]
            dist.all_gather(parts, x.contiguous(), group=self.group)
            total = parts[0]
            for part in parts[1:]:
                total = total.add_(part)
            return x.copy_(total)
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., n]`` per rank -> ``[..., world_size * n]``, rank 0's columns first."""
        if not self.enabled:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)


def init_distributed(
    parallel_config: ParallelConfig,
    device: torch.device,
    timeout: timedelta = DEFAULT_DIST_TIMEOUT,
) -> TensorParallel:
    """Join this engine's ranks (blocks until all have joined); idempotent."""
    world_size = parallel_config.tensor_parallel_size
    rank = parallel_config.rank
    if world_size == 1:
        return TensorParallel.single()
    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise ConfigError(
                f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, not rank {rank} of {world_size}"
            )
        return TensorParallel(rank, world_size, dist.group.WORLD)
    init_method = parallel_config.dist_init_method or "env://"
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    logger.info("rank %d of %d: joining %s process group at %s", rank, world_size, backend, init_method)
    startup.phase(f"joining the tensor-parallel group ({world_size} ranks) at {init_method}")
    dist.init_process_group(
        backend=backend, init_method=init_method, world_size=world_size, rank=rank, timeout=timeout
    )
    logger.info("rank %d of %d: process group up", rank, world_size)
    return TensorParallel(rank, world_size, dist.group.WORLD)


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def tp_device(name: str, parallel_config: ParallelConfig) -> torch.device:
    """The device of this rank: ``auto`` and bare ``cuda`` pick GPU ``rank % count``
    under TP (one rank per GPU); an explicit ``cuda:N`` or ``cpu`` is kept."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and parallel_config.tensor_parallel_size > 1:
        return torch.device("cuda", parallel_config.rank % torch.cuda.device_count())
    return torch.device(name)


# --------------------------------------------------------------------------- sharding


@dataclass(frozen=True)
class ShardLayout:
    """Which part of each sharded weight this rank holds (head, row and vocab ranges)."""

    rank: int
    world_size: int
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank (1 when replicated)
    head_start: int  # first query head
    kv_head_start: int  # first KV head
    kv_replicated: bool  # fewer KV heads than ranks: each rank keeps the one its q heads use
    intermediate_size: int  # MLP columns on this rank
    inter_start: int
    vocab_size: int  # the model's true vocabulary
    vocab_per_rank: int  # rows of the (padded) vocabulary on this rank
    vocab_start: int

    @property
    def vocab_stop(self) -> int:
        """End of this rank's real (unpadded) vocabulary rows."""
        return max(self.vocab_start, min(self.vocab_start + self.vocab_per_rank, self.vocab_size))

    @classmethod
    def for_rank(cls, config: ModelConfig, rank: int = 0, world_size: int = 1) -> "ShardLayout":
        nh, nkv, tp = config.num_attention_heads, config.num_key_value_heads, world_size
        if nh % tp:
            raise ConfigError(f"tensor_parallel_size {tp} must divide the {nh} attention heads")
        if nkv >= tp:
            if nkv % tp:
                raise ConfigError(f"tensor_parallel_size {tp} must divide the {nkv} KV heads")
            kv_per_rank, kv_start, replicated = nkv // tp, rank * (nkv // tp), False
        else:
            if tp % nkv:
                raise ConfigError(
                    f"with fewer KV heads ({nkv}) than ranks, tensor_parallel_size {tp} must be a "
                    "multiple of the KV heads"
                )
            # Rank r's q heads [r*nh/tp, (r+1)*nh/tp) all read kv head h // (nh/nkv) = r*nkv//tp.
            kv_per_rank, kv_start, replicated = 1, rank * nkv // tp, True
        if config.intermediate_size % tp:
            raise ConfigError(
                f"tensor_parallel_size {tp} must divide intermediate_size {config.intermediate_size}"
            )
        inter = config.intermediate_size // tp
        vocab_per_rank = -(-config.vocab_size // tp)  # vocabulary padded to a multiple of tp
        return cls(
            rank=rank,
            world_size=tp,
            num_heads=nh // tp,
            num_kv_heads=kv_per_rank,
            head_start=rank * (nh // tp),
            kv_head_start=kv_start,
            kv_replicated=replicated,
            intermediate_size=inter,
            inter_start=rank * inter,
            vocab_size=config.vocab_size,
            vocab_per_rank=vocab_per_rank,
            vocab_start=rank * vocab_per_rank,
        )
