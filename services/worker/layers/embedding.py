"""The token embedding and the LM head, vocab-parallel under tensor parallelism.

Each rank holds its slice of the (padded) vocabulary's rows. The embedding looks up only
its rows (zeros elsewhere) and all-reduces; the LM head computes its vocabulary slice of the
logits and all-gathers the full row. With one rank both are the plain single-device code,
chosen at construction. A tied LM head reads the embedding's table. Either table may stay
quantized (the embedding's lookups then unpack rows of it); ``scale`` multiplies the
embedding's output (Gemma's ``sqrt(hidden_size)``).
"""

from __future__ import annotations

import torch
from torch import nn

from shared.model_config import ModelConfig

from ..linear import cpu_layout, plain_linear, quantized_embedding, quantized_linear
from ..parallel import ShardLayout, TensorParallel
from .weights import Quantizable, weight_slot


def _vocab_rows(config: ModelConfig, shard: ShardLayout, tp: TensorParallel) -> tuple[int, int, int]:
    """(rows held, first checkpoint row, end checkpoint row) of this rank's vocabulary."""
    if tp.enabled:
        return shard.vocab_per_rank, shard.vocab_start, shard.vocab_stop
    return config.vocab_size, 0, config.vocab_size


class VocabEmbedding(nn.Module, Quantizable):
    def __init__(self, config: ModelConfig, shard: ShardLayout, tp: TensorParallel, name: str = "model.embed_tokens",
                 scale: float | None = None) -> None:
        super().__init__()
        self.name, self.tp, self.shard = name, tp, shard
        # As Hugging Face scales (a float32 tensor cast to the activations' dtype).
        self.scale = None if scale is None else torch.tensor(scale, dtype=torch.float32)
        self.vocab_size, self.hidden_size = config.vocab_size, config.hidden_size
        rows, self.row_start, self.row_stop = _vocab_rows(config, shard, tp)
        # Rows past the true vocabulary (padding on the last rank(s)) stay zero.
        self.weight = nn.Parameter(torch.zeros(rows, config.hidden_size), requires_grad=False)
        self.checkpoint_names = (f"{name}.weight",)
        self.quantized = None
        self.lookup = self._lookup_vocab_parallel if tp.enabled else self._lookup

    def weight_slots(self):
        target = self.weight.data[: self.row_stop - self.row_start]
        yield f"{self.name}.weight", weight_slot(target, (self.vocab_size, self.hidden_size), 0, self.row_start,
                                                 self.row_stop)

    def keep_quantized(self, tensor, batch_invariant: bool = False) -> None:
        device = self.weight.device
        self.quantized = cpu_layout(tensor.to(device))
        self.weight.data = torch.empty(0, dtype=self.weight.dtype, device=device)
        self.lookup = self._lookup_quantized
        self.batch_invariant = batch_invariant  # a tied LM head's products, as its table's

    def forward(self, input_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``dtype``: the activations' (a quantized table has none of its own)."""
        x = self.lookup(input_ids, dtype)
        return x if self.scale is None else x * self.scale.to(device=x.device, dtype=x.dtype)

    def _lookup(self, input_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return nn.functional.embedding(input_ids, self.weight)

    def _lookup_quantized(self, input_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return quantized_embedding(self.quantized, input_ids, dtype)

    def _lookup_vocab_parallel(self, input_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        start = self.shard.vocab_start
        outside = (input_ids < start) | (input_ids >= start + self.shard.vocab_per_rank)
        x = nn.functional.embedding((input_ids - start).masked_fill_(outside, 0), self.weight)
        x.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(x)

    def quantized_bytes(self) -> int:
        return 0 if self.quantized is None else self.quantized.nbytes()


class LMHead(nn.Module, Quantizable):
    """Hidden states -> full float32 logits. ``tied``: the embedding whose table it reads
    (None: its own ``lm_head.weight``)."""

    def __init__(self, config: ModelConfig, shard: ShardLayout, tp: TensorParallel, tied: VocabEmbedding | None,
                 name: str = "lm_head") -> None:
        super().__init__()
        self.name, self.tp, self.vocab_size, self.hidden_size = name, tp, config.vocab_size, config.hidden_size
        self.tied = tied
        rows, self.row_start, self.row_stop = _vocab_rows(config, shard, tp)
        if tied is None:
            self.weight = nn.Parameter(torch.zeros(rows, config.hidden_size), requires_grad=False)
            self.checkpoint_names = (f"{name}.weight",)
            self.proj = plain_linear(self, "weight")
        else:
            self.weight = None
            self.checkpoint_names = ()  # the embedding's table: quantized with it
            self.proj = plain_linear(tied, "weight")
        self.quantized = None
        self.forward = self._logits_vocab_parallel if tp.enabled else self._logits

    def weight_slots(self):
        if self.weight is not None:
            target = self.weight.data[: self.row_stop - self.row_start]
            yield f"{self.name}.weight", weight_slot(target, (self.vocab_size, self.hidden_size), 0,
                                                     self.row_start, self.row_stop)

    def keep_quantized(self, tensor, batch_invariant: bool = False) -> None:
        device = self.weight.device
        self.quantized = cpu_layout(tensor.to(device))
        self.weight.data = torch.empty(0, dtype=self.weight.dtype, device=device)
        self.proj = quantized_linear(self.quantized, batch_invariant=batch_invariant, widened=True)

    def after_loading(self) -> None:
        if self.tied is not None and self.tied.quantized is not None:
            self.proj = quantized_linear(self.tied.quantized, batch_invariant=self.tied.batch_invariant, widened=True)

    def prepack(self, pack) -> int:
        """Lay the float table out once with ``pack`` (``..linear.weight_packer``); returns
        the bytes of the packed copy. Its own table's checkpoint-layout copy is dropped; a
        tied embedding keeps its table for the lookups."""
        if self.quantized is not None or (self.tied is not None and self.tied.quantized is not None):
            return 0
        weight = self.tied.weight if self.tied is not None else self.weight
        self.proj = pack(weight)
        nbytes = weight.nbytes
        if self.tied is None:
            self.weight.data = torch.empty(0, dtype=weight.dtype, device=weight.device)
        return nbytes

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> full logits ``[N, vocab]`` in float32 (rounded to the hidden
        states' dtype first, as Hugging Face's; a quantized table's product returns them so)."""
        return self.proj(hidden).float()

    def _logits_vocab_parallel(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.proj(hidden)
        return self.tp.all_gather_last_dim(local)[:, : self.vocab_size].float()

    def quantized_bytes(self) -> int:
        return 0 if self.quantized is None else self.quantized.nbytes()
