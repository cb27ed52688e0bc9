"""A mixture-of-experts MLP: the router, top-k routing, and the experts as stacked weights.

The router is a replicated matrix ``[experts, hidden]``; routing is Hugging Face's
(``kernels.fused_moe.select_experts``: float32 softmax, top-k, renormalised where the model
says); the experts run through ``KernelOps.fused_moe`` (grouped products on CPU, grouped
GEMMs in Triton on CUDA). Each expert's gate and up rows are stacked into ``w13``
``[experts, 2 * intermediate, hidden]`` and its down matrix into ``w2``
``[experts, hidden, intermediate]``.

Under tensor parallelism the experts are split as vLLM's FusedMoE splits them: every rank
holds every expert, each with its slice of the intermediate size (gate/up rows
column-parallel, down columns row-parallel), and the ranks' partial sums are all-reduced.
The expert weights stay float (a GGUF file's quantized experts are dequantized at load).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import KernelOps
from kernels.fused_moe import select_experts
from shared.config import ConfigError
from shared.model_config import ModelConfig

from ..parallel import TensorParallel
from .linear import replicated
from .weights import weight_slot


class FusedMoE(nn.Module):
    """``expert_names``: the checkpoint names of an expert's gate, up and down matrices
    (``{prefix}.experts.{e}.{name}.weight``); ``router``: the router's (``{prefix}.{router}``)."""

    def __init__(self, config: ModelConfig, ops: KernelOps, tp: TensorParallel, prefix: str,
                 expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                 router: str = "gate") -> None:
        super().__init__()
        experts, hidden, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size
        if inter % tp.world_size:
            raise ConfigError(f"tensor_parallel_size {tp.world_size} must divide moe_intermediate_size {inter}")
        self.prefix, self.expert_names, self.ops = prefix, expert_names, ops
        self.num_experts, self.hidden, self.inter_full = experts, hidden, inter
        self.inter = inter // tp.world_size
        self.inter_start = tp.rank * self.inter
        self.top_k, self.renormalize = config.num_experts_per_tok, config.norm_topk_prob
        self.activation = config.hidden_act
        self.router = replicated(f"{prefix}.{router}", experts, hidden)
        self.w13 = nn.Parameter(torch.empty(experts, 2 * self.inter, hidden), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(experts, hidden, self.inter), requires_grad=False)
        self.all_reduce = tp.all_reduce

    def weight_slots(self):
        gate, up, down = self.expert_names
        start, stop, inter = self.inter_start, self.inter_start + self.inter, self.inter
        for e in range(self.num_experts):
            name = f"{self.prefix}.experts.{e}"
            full = (self.inter_full, self.hidden)
            yield f"{name}.{gate}.weight", weight_slot(self.w13.data[e, :inter], full, 0, start, stop)
            yield f"{name}.{up}.weight", weight_slot(self.w13.data[e, inter:], full, 0, start, stop)
            yield f"{name}.{down}.weight", weight_slot(self.w2.data[e], (self.hidden, self.inter_full), 1, start, stop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self.router(x), self.top_k, self.renormalize)
        return self.all_reduce(self.ops.fused_moe(x, self.w13, self.w2, weights, ids, self.activation))
