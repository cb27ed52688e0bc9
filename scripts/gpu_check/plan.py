"""The GPU check's steps, in the order they run, with their time boxes.

The order puts what must work before what is measured: the kernels against their
references, then decode attention's bandwidth, greedy parity with transformers, the
services stack, and the throughput comparison last (it records each batch as it goes, so
what a cut leaves is still read). ``wheels`` runs first, in the check's own process.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Step:
    name: str
    module: str  # its run(ctx) runs in the step's process; the rest renders its part of the report
    max_s: float
    title: str


WHEELS_STEP = Step("wheels", "gpu_check.wheels", 90, "install the carried wheels with no network")
STEPS = (
    Step("environment", "gpu_check.environment", 60, "versions, the device, a first Triton kernel"),
    Step("kernels", "gpu_check.kernel_tests", 150, "pytest -m cuda: every Triton kernel against its reference"),
    Step("attention_bandwidth", "gpu_check.attention_bandwidth", 60,
         "decode attention's bandwidth against a device-to-device copy"),
    Step("greedy", "gpu_check.greedy", 150, "the in-process engine against transformers, float32, token for token"),
    Step("services", "gpu_check.services_stack", 150, "the services stack serving 16 concurrent streams"),
    Step("throughput", "gpu_check.throughput", 210,
         "the in-process engine against transformers' generate (bfloat16), and a step's time split"),
    Step("decode_graph", "gpu_check.decode_graph", 90,
         "what CUDA graphs would give: a decode forward pass replayed from a graph against launched"),
    Step("features", "gpu_check.features", 120,
         "the engine's request features on the GPU against the same engine on the CPU"),
)
MODULES = {step.name: step.module for step in (WHEELS_STEP, *STEPS)}
