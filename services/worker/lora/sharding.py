"""LoRA under tensor parallelism: this rank's part of each fused projection's A and B.

As vLLM shards them (and as ``layers/linear.py`` shards the base weights):

- column-parallel qkv and gate_up: the rank computes only its output columns, so A
  stays whole and B keeps the rows of those columns (its q, k and v heads; its gate and
  up columns);
- row-parallel o and down: the rank holds only its input rows, so A keeps those columns
  and B stays whole; the rank's delta ``B A_r x_r`` is a partial sum, added to the base
  product's partial sum before the all-reduce that sums both (``slots.py``).

With one rank every slice is the whole tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.lora_shapes import ProjectionShapes
from shared.model_config import ModelConfig

from ..parallel import ShardLayout


def _index(ranges: list[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([torch.arange(start, stop) for start, stop in ranges])


@dataclass(frozen=True)
class LoRAShard:
    """Per fused projection: the A columns and B rows this rank keeps (None: all), its
    local input and output sizes, and the local output width of each sub-module (B's
    diagonal blocks)."""

    a_columns: dict[str, torch.Tensor | None]
    b_rows: dict[str, torch.Tensor | None]
    in_features: dict[str, int]
    out_splits: dict[str, tuple[int, ...]]

    @property
    def out_features(self) -> dict[str, int]:
        return {p: sum(widths) for p, widths in self.out_splits.items()}

    @classmethod
    def of(cls, config: ModelConfig, shard: ShardLayout | None) -> "LoRAShard":
        full = ProjectionShapes.of(config)
        if shard is None or shard.world_size == 1:
            return cls({p: None for p in full.in_features}, {p: None for p in full.in_features},
                       dict(full.in_features), dict(full.out_features))
        hd = config.head_dim
        q_full, kv_full = config.num_attention_heads * hd, config.num_key_value_heads * hd
        q = (shard.head_start * hd, (shard.head_start + shard.num_heads) * hd)
        kv = (shard.kv_head_start * hd, (shard.kv_head_start + shard.num_kv_heads) * hd)
        inter_full = config.intermediate_size
        inter = (shard.inter_start, shard.inter_start + shard.intermediate_size)
        qkv_rows = [q, (q_full + kv[0], q_full + kv[1]), (q_full + kv_full + kv[0], q_full + kv_full + kv[1])]
        gate_up_rows = [inter, (inter_full + inter[0], inter_full + inter[1])]
        hidden = config.hidden_size
        return cls(
            a_columns={"qkv": None, "o": _index([q]), "gate_up": None, "down": _index([inter])},
            b_rows={"qkv": _index(qkv_rows), "o": None, "gate_up": _index(gate_up_rows), "down": None},
            in_features={"qkv": hidden, "o": q[1] - q[0], "gate_up": hidden, "down": inter[1] - inter[0]},
            out_splits={"qkv": tuple(b - a for a, b in qkv_rows), "o": (hidden,),
                        "gate_up": tuple(b - a for a, b in gate_up_rows), "down": (hidden,)},
        )

    def a(self, projection: str, a: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full ``[R, in]`` A."""
        columns = self.a_columns[projection]
        return a if columns is None else a.index_select(1, columns)

    def b(self, projection: str, b: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full ``[out, R]`` B."""
        rows = self.b_rows[projection]
        return b if rows is None else b.index_select(0, rows)
